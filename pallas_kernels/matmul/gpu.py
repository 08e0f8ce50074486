"""Quantized matmul for GPU (Pallas Triton): weights dequantized in registers, tensor-core dots.

Grid (M / bm, N / bn, splits); each program loops over its split's share of K (split-K:
decode's few rows give too few output tiles to fill a GPU), the partial sums added after. int8 weights are widened to the
activation dtype per [bk, bn] tile (W8A16) or multiplied as int8 x int8 into int32 (W8A8,
Ampere and newer). An int4 K step is exactly one group: its [G/2, bn] bytes unpack with one
shift-and-mask each into the group's two row halves (layout: `packing.py`), each a
tensor-core dot against the matching contiguous half of the activation tile, so the
weights cross memory at 4 bits and no register shuffle is needed. Rows (tokens) are padded
to 16, the smallest tensor-core dot, which is what decode at small batch pays.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.errors import UserError
from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.matmul import block_sizes
from jaxpar.pallas_kernels.matmul.format import INT4_SYMMETRIC_ZERO, QuantizedWeight, pad_weight
from jaxpar.pallas_kernels.platform import multiprocessors


@dataclasses.dataclass(frozen=True)
class _Static:
  mode: str
  block_k: int
  k_steps: int  # K steps each program takes: its split's share of K


def _dot(a, b, acc_dtype=jnp.float32):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=acc_dtype)


def _kernel(x_ref, v_ref, s_ref, z_ref, o_ref, *, st):
  """One split's sum over its K steps, unscaled but for int4's group scales (s_ref, z_ref:
  int4 only): per-channel and per-token scales factor out of the sum and apply after it."""
  bk, first = st.block_k, pl.program_id(2) * st.k_steps

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
  o_ref[...] = lax.fori_loop(first, first + st.k_steps, step, jnp.zeros(o_ref.shape, acc_dtype))


def default_splits(programs: int, k_steps: int) -> int:
  """Programs that share one output tile's K (split-K): only where the output tiles alone
  leave at least half the multiprocessors idle, up to one program per multiprocessor. On an
  H200 (132 of them) at M16, K = N = 8192, 128 tiles: int8 took 0.049 ms unsplit and 0.077
  split 8 ways (docs/benchmarks.md#gpu). A power of two dividing the K steps."""
  spare = multiprocessors() // programs
  return math.gcd(1 << max(spare.bit_length() - 1, 0), k_steps)


def quantized_matmul_gpu(x, w: QuantizedWeight, x_scales=None, *, blocks=None, splits=None, interpret=False):
  """x [M, K] (float; int8 with x_scales [M, 1] for W8A8) -> float32 [M, N]. splits: programs
  per output tile, each over its share of K, their partial sums added after (None:
  `default_splits`; it must divide the K steps)."""
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
  steps = kp // bk
  splits = splits or default_splits((mp // bm) * (np_ // bn), steps)
  if steps % splits:
    raise UserError(f"splits={splits} must divide the {steps} K steps of {bk} (K={k})")
  int4 = w.mode == "int4"
  group_spec = pl.BlockSpec((w.scales.shape[0], bn), lambda i, j, s: (0, j))
  st = _Static(mode=w.mode, block_k=bk, k_steps=steps // splits)
  out = pl.pallas_call(
      functools.partial(_kernel, st=st),
      grid=(mp // bm, np_ // bn, splits),
      in_specs=[pl.BlockSpec((bm, kp), lambda i, j, s: (i, 0)),
                pl.BlockSpec((w.values.shape[0], bn), lambda i, j, s: (0, j)),
                group_spec if int4 else None, group_spec if w.zeros is not None else None],
      out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
      out_shape=jax.ShapeDtypeStruct((splits, mp, np_), jnp.int32 if w.mode == "w8a8" else jnp.float32,
                                     manual_axis_type=jax.typeof(x).mat),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
      name=f"quantized_matmul_{w.mode}",
  )(x, w.values, w.scales if int4 else None, w.zeros)
  out = out.sum(axis=0)[:m, :n].astype(jnp.float32)  # W8A8: the int32 sums add exactly
  if not int4:
    out = out * w.scales[:, :n]
  return out if x_scales is None else out * x_scales
