"""Quantizers: float arrays -> integers + scales (+ zero points), and weights -> QuantizedWeight.

`quantize_int` is the one rounding rule everything uses (weights, activations, KV cache):
- symmetric:  scale = max|x| / (2^(b-1) - 1),  q = round(x / scale) in [-(2^(b-1)-1), 2^(b-1)-1]
- asymmetric: scale = (max - min) / (2^b - 1), zero = -min / scale,
              q = round(x / scale + zero) in [0, 2^b - 1]; x ~ (q - zero) * scale
Both reduce over the given axes (per channel, per token, per group: the caller's reshape
picks). Round-to-nearest keeps every element within scale / 2 of its original value; an
all-constant slice gets scale 1 and round-trips exactly.
"""

import jax.numpy as jnp

from jaxpar.errors import UserError
from jaxpar.pallas_kernels.matmul import packing
from jaxpar.pallas_kernels.matmul.format import INT4_SYMMETRIC_ZERO, QuantizedWeight, check_group_size


def quantize_int(x, bits: int, axis, *, symmetric: bool = True):
  """-> (q int32, scale f32, zero f32 or None), scale/zero with `axis` kept as size 1."""
  x = x.astype(jnp.float32)
  if symmetric:
    qmax = 2 ** (bits - 1) - 1
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / qmax
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x / scale), -qmax, qmax).astype(jnp.int32), scale, None
  levels = 2 ** bits - 1
  lo, hi = jnp.min(x, axis=axis, keepdims=True), jnp.max(x, axis=axis, keepdims=True)
  scale = jnp.where(hi > lo, (hi - lo) / levels, 1.0)
  zero = -lo / scale
  return jnp.clip(jnp.round(x / scale + zero), 0, levels).astype(jnp.int32), scale, zero


def dequantize_int(q, scale, zero=None):
  return (q.astype(jnp.float32) - (0.0 if zero is None else zero)) * scale


def quantize_weight(w, mode: str, group_size: int | None = None, *,
                    zero_point: bool = False) -> QuantizedWeight:
  """A float [K, N] weight -> QuantizedWeight. int8 / w8a8: symmetric, one scale per output
  channel. int4: one scale per group of `group_size` rows of K per output channel,
  symmetric, or asymmetric with `zero_point` (a zero per group)."""
  k, n = w.shape
  check_group_size(mode, group_size, k)
  if mode != "int4":
    if zero_point:
      raise UserError(f"zero_point=True applies to mode='int4' only, not mode={mode!r}")
    q, scale, _ = quantize_int(w, 8, axis=0)
    return QuantizedWeight(q.astype(jnp.int8), scale, mode=mode)
  grouped = w.reshape(k // group_size, group_size, n)
  q, scale, zero = quantize_int(grouped, 4, axis=1, symmetric=not zero_point)
  if zero is None:
    q = q + INT4_SYMMETRIC_ZERO
  values = packing.pack(q.reshape(k, n), 4, axis=0, group=group_size)
  return QuantizedWeight(values, scale[:, 0], None if zero is None else zero[:, 0],
                         mode="int4", group_size=group_size)


def dequantize_weight(w: QuantizedWeight):
  """The f32 [K, N] weight a QuantizedWeight stands for."""
  if w.mode != "int4":
    return w.values.astype(jnp.float32) * w.scales
  k, n = w.shape
  g = w.group_size
  q = packing.unpack(w.values, 4, axis=0, group=g).reshape(k // g, g, n)
  zero = INT4_SYMMETRIC_ZERO if w.zeros is None else w.zeros[:, None]
  return dequantize_int(q, w.scales[:, None], zero).reshape(k, n)


def quantize_rows(x):
  """Per-token (per-row) symmetric int8 for W8A8: x [M, K] -> (int8 [M, K], f32 [M, 1])."""
  q, scale, _ = quantize_int(x, 8, axis=-1)
  return q.astype(jnp.int8), scale
