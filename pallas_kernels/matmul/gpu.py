"""Quantized matmul for GPU (Pallas Triton): weights dequantized in registers, tensor-core dots.

Grid (M / bm, N / bn); each program loops over K. int8 weights are widened to the
activation dtype per [bk, bn] tile (W8A16) or multiplied as int8 x int8 into int32 (W8A8,
Ampere and newer). An int4 K step is exactly one group: its [G/2, bn] bytes unpack with one
shift-and-mask each into the group's two row halves (layout: `packing.py`), each a
tensor-core dot against the matching contiguous half of the activation tile, so the
weights cross memory at 4 bits and no register shuffle is needed. Rows (tokens) are padded
to 16, the smallest tensor-core dot, which is what decode at small batch pays.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.matmul import block_sizes
from jaxpar.pallas_kernels.matmul.format import INT4_SYMMETRIC_ZERO, QuantizedWeight, pad_weight


@dataclasses.dataclass(frozen=True)
class _Static:
  mode: str
  group_size: int | None
  has_zeros: bool
  block_k: int
  k_steps: int


def _dot(a, b, acc_dtype=jnp.float32):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=acc_dtype)


def _kernel(*refs, st):
  x_ref, v_ref, s_ref = refs[:3]
  rest = list(refs[3:])
  z_ref = rest.pop(0) if st.has_zeros else None
  xs_ref = rest.pop(0) if st.mode == "w8a8" else None
  (o_ref,) = rest
  bk = st.block_k

  def step(k, acc):
    if st.mode == "w8a8":
      return acc + _dot(x_ref[:, pl.ds(k * bk, bk)], v_ref[pl.ds(k * bk, bk), :], jnp.int32)
    if st.mode == "int8":
      x = x_ref[:, pl.ds(k * bk, bk)]
      return acc + _dot(x, v_ref[pl.ds(k * bk, bk), :].astype(jnp.float32).astype(x.dtype))
    half = bk // 2  # int4: one group per step
    p = v_ref[pl.ds(k * half, half), :].astype(jnp.int32)
    s = s_ref[pl.ds(k, 1), :]
    z = INT4_SYMMETRIC_ZERO if z_ref is None else z_ref[pl.ds(k, 1), :]
    for j, plane in enumerate((p & 0xF, (p >> 4) & 0xF)):
      x = x_ref[:, pl.ds(k * bk + j * half, half)]
      acc = acc + _dot(x, ((plane.astype(jnp.float32) - z) * s).astype(x.dtype))
    return acc

  acc_dtype = jnp.int32 if st.mode == "w8a8" else jnp.float32
  acc = lax.fori_loop(0, st.k_steps, step, jnp.zeros(o_ref.shape, acc_dtype))
  out = acc.astype(jnp.float32)
  if st.mode != "int4":
    out = out * s_ref[...]
  if xs_ref is not None:
    out = out * xs_ref[...]
  o_ref[...] = out


def quantized_matmul_gpu(x, w: QuantizedWeight, x_scales=None, *, blocks=None, interpret=False):
  """x [M, K] (float; int8 with x_scales [M, 1] for W8A8) -> float32 [M, N]."""
  blocks = blocks or block_sizes.GPU_DEFAULT
  block_sizes.check_blocks(blocks, "gpu")
  (m, k), n = x.shape, w.shape[1]
  bm = min(blocks.block_m, max(16, pl.next_power_of_2(m)))
  mp, np_ = tiling.round_up(m, bm), tiling.round_up(n, blocks.block_n)
  bk = w.group_size if w.mode == "int4" else blocks.block_k
  kp = tiling.round_up(k, bk)
  x = tiling.pad_axis(tiling.pad_axis(x, 0, mp), 1, kp)
  if (kp, np_) != (k, n):
    w = pad_weight(w, kp, np_)
  bn = blocks.block_n
  groups = w.scales.shape[0]
  in_specs = [pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
              pl.BlockSpec((w.values.shape[0], bn), lambda i, j: (0, j)),
              pl.BlockSpec((groups, bn), lambda i, j: (0, j))]
  args = [x, w.values, w.scales]
  if w.zeros is not None:
    in_specs.append(pl.BlockSpec((groups, bn), lambda i, j: (0, j)))
    args.append(w.zeros)
  if w.mode == "w8a8":
    in_specs.append(pl.BlockSpec((bm, 1), lambda i, j: (i, 0)))
    args.append(tiling.pad_axis(x_scales, 0, mp))
  st = _Static(mode=w.mode, group_size=w.group_size, has_zeros=w.zeros is not None, block_k=bk,
               k_steps=kp // bk)
  out = pl.pallas_call(
      functools.partial(_kernel, st=st),
      grid=(mp // bm, np_ // bn),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((mp, np_), jnp.float32, manual_axis_type=jax.typeof(x).mat),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name=f"quantized_matmul_{w.mode}",
  )(*args)
  return out[:m, :n]
