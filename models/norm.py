"""RMSNorm (Zhang & Sennrich, 2019): scale by the root-mean-square, no mean, no bias."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last axis; `scale` [dim] is declared `weight_decay=False`
  (shrinking it towards 0 would only fight the normalisation). unit_offset: multiply by
  (1 + scale) with scale starting at 0, as Gemma stores it."""

  def __init__(self, dim: int, *, eps: float, param_dtype, compute_dtype, names=("norm",),
               unit_offset: bool = False):
    init = jnp.zeros if unit_offset else jnp.ones
    self.scale = nnx.Param(init((dim,), param_dtype), out_sharding=names, weight_decay=False)
    self.eps, self.unit_offset = eps, unit_offset
    self.compute_dtype = compute_dtype

  def __call__(self, x):
    scale = self.scale[...].astype(jnp.float32)
    return (normalize(x, self.eps) * (1.0 + scale if self.unit_offset else scale)).astype(self.compute_dtype)


def normalize(x, eps: float):
  """x / rms(x) over the last axis, in float32 (bf16 sums of squares lose too much
  precision): an RMSNorm without a scale (Gemma 4's value norm)."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
