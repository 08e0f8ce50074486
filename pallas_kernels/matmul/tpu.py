"""Quantized matmul for TPU (Mosaic): int8 / int4 weights dequantized tile by tile in VMEM,
and W8A8 int8 x int8 on the MXU's integer path.

Grid (M / bm, N / bn, K / bk), K innermost ("arbitrary"): the output block [bm, bn]
(float32, or int32 for W8A8) stays in VMEM over the K tiles and accumulates them; the last
K step applies an int8 weight's per-channel scales. Weights reach the kernel as
[K / bk, rows per tile, N] so every block's last two dims are whole (any K tile is a legal
Mosaic block, whatever the int8 sublane tiling). An int4 tile is unpacked with two
shift-and-mask ops into whole-group row blocks (layout: `packing.py`) and dequantized in
float32 before the MXU dot; only 4 bits per weight cross HBM.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.matmul import block_sizes
from jaxpar.pallas_kernels.matmul.format import INT4_SYMMETRIC_ZERO, QuantizedWeight, pad_weight
from jaxpar.pallas_kernels.tpu_matmul import mxu_dot


@dataclasses.dataclass(frozen=True)
class _Static:
  mode: str
  group_size: int | None
  has_zeros: bool
  k_steps: int


def dequantize_int4_tile(packed, scales, zeros, group):
  """[bk/2, bn] planar-packed bytes, [bk/G, bn] scales (and zeros) -> float32 [bk, bn]."""
  p = packed.astype(jnp.int32)
  planes = (p & 0xF, (p >> 4) & 0xF)
  half = group // 2
  pieces = []
  for g in range(scales.shape[0]):
    s = scales[g:g + 1]
    z = INT4_SYMMETRIC_ZERO if zeros is None else zeros[g:g + 1]
    pieces += [(plane[g * half:(g + 1) * half].astype(jnp.float32) - z) * s for plane in planes]
  return jnp.concatenate(pieces, axis=0)


def _kernel(*refs, st):
  x_ref, v_ref, s_ref = refs[:3]
  z_ref = refs[3] if st.has_zeros else None
  o_ref = refs[-1]
  k = pl.program_id(2)

  @pl.when(k == 0)
  def _init():
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

  x = x_ref[...]
  if st.mode == "w8a8":
    o_ref[...] += mxu_dot(x, v_ref[...])
  elif st.mode == "int8":
    o_ref[...] += mxu_dot(x, v_ref[...].astype(jnp.float32).astype(x.dtype))
  else:
    w = dequantize_int4_tile(v_ref[...], s_ref[...], None if z_ref is None else z_ref[...],
                             st.group_size)
    o_ref[...] += mxu_dot(x, w.astype(x.dtype))

  if st.mode == "int8":
    @pl.when(k == st.k_steps - 1)
    def _scale():
      o_ref[...] *= s_ref[...]


def quantized_matmul_tpu(x, w: QuantizedWeight, x_scales=None, *, blocks=None, interpret=False):
  """x [M, K] (float; int8 with x_scales [M, 1] for W8A8) -> float32 [M, N]."""
  blocks = blocks or block_sizes.TPU_DEFAULT
  block_sizes.check_blocks(blocks, "tpu")
  (m, k), n = x.shape, w.shape[1]
  bm, mp = (m, m) if m <= blocks.block_m else block_sizes.fit(m, blocks.block_m, 32)
  bn, np_ = block_sizes.fit(n, blocks.block_n, 128)
  bk, kp = block_sizes.fit_k(k, blocks.block_k, w.group_size, 128)
  x = tiling.pad_axis(tiling.pad_axis(x, 0, mp), 1, kp)
  if (kp, np_) != (k, n):
    w = pad_weight(w, kp, np_)
  rows = bk // 2 if w.mode == "int4" else bk
  groups = bk // w.group_size if w.mode == "int4" else 1
  values = w.values.reshape(kp // bk, rows, np_)
  tiled = lambda a: a.reshape(kp // bk, groups, np_) if w.mode == "int4" else a
  scale_spec = (pl.BlockSpec((None, groups, bn), lambda i, j, kk: (kk, 0, j)) if w.mode == "int4"
                else pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)))
  in_specs = [pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
              pl.BlockSpec((None, rows, bn), lambda i, j, kk: (kk, 0, j)), scale_spec]
  args = [x, values, tiled(w.scales)]
  if w.zeros is not None:
    in_specs.append(scale_spec)
    args.append(tiled(w.zeros))
  st = _Static(mode=w.mode, group_size=w.group_size, has_zeros=w.zeros is not None,
               k_steps=kp // bk)
  # The output block stays put over K, so it is the accumulator (int32 for W8A8, whose
  # per-token and per-channel scales are one fused multiply after the kernel).
  acc = jnp.int32 if w.mode == "w8a8" else jnp.float32
  out = pl.pallas_call(
      functools.partial(_kernel, st=st),
      grid=(mp // bm, np_ // bn, kp // bk),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), acc, manual_axis_type=jax.typeof(x).mat),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=pl.CostEstimate(flops=2 * mp * np_ * kp, transcendentals=0,
                                    bytes_accessed=x.nbytes + w.nbytes + mp * np_ * 4),
      interpret=interpret,
      name=f"quantized_matmul_{w.mode}",
  )(*args)[:m, :n]
  if w.mode == "w8a8":
    return out.astype(jnp.float32) * w.scales[:, :n] * x_scales
  return out
