"""RMSNorm (Zhang & Sennrich, 2019): scale by the root-mean-square, no mean, no bias."""

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """x / rms(x) * scale over the last axis; `scale` [dim] is declared `weight_decay=False`
  (shrinking it towards 0 would only fight the normalisation)."""

  def __init__(self, dim: int, *, eps: float, param_dtype, compute_dtype, names=("norm",)):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=names, weight_decay=False)
    self.eps = eps
    self.compute_dtype = compute_dtype

  def __call__(self, x):
    # Normalise in float32: bf16 sums of squares lose too much precision.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(self.compute_dtype)
