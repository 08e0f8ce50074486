"""Pure-jnp quantized matmuls: the definitions the kernels are tested against, and the XLA
path on CPU (dequantize + dot: the weights stay small at rest, one layer's weight is
widened at a time).

All return float32 [M, N]; the door casts to the activation dtype (after any cross-device
sum, so partial sums of a K-split weight add up in float32).
"""

import jax
import jax.numpy as jnp

from jaxpar.pallas_kernels.matmul.format import QuantizedWeight
from jaxpar.pallas_kernels.matmul.quantize import dequantize_weight


def weight_only_reference(x, w: QuantizedWeight):
  """W8A16 / W4A16: x [M, K] (float) times the dequantized weight, accumulated in float32.
  The weight is widened to x's dtype first, as the kernels do tile by tile; a per-channel
  scale is applied after the sum (it factors out of it), group scales before."""
  dims = (((1,), (0,)), ((), ()))
  if w.mode == "int8":
    y = jax.lax.dot_general(x, w.values.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return y * w.scales
  return jax.lax.dot_general(x, dequantize_weight(w).astype(x.dtype), dims,
                             preferred_element_type=jnp.float32)


def w8a8_reference(xq, x_scales, w: QuantizedWeight):
  """W8A8: int8 [M, K] activations (scales f32 [M, 1]) times int8 weights, summed exactly
  in int32, then scaled per token and per output channel."""
  acc = jax.lax.dot_general(xq, w.values, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.int32)
  return acc.astype(jnp.float32) * w.scales * x_scales  # the kernels' order: bit-equal


def outlier_columns(x, count: int):
  """The `count` input channels with the largest |x| over all tokens -> (x with those
  columns zeroed, their indices). LLM.int8()-style decomposition, chosen per call so it
  needs no calibration data: a few outlier channels no longer set every token's scale."""
  index = jax.lax.top_k(jnp.max(jnp.abs(x), axis=0), count)[1]
  return x.at[:, index].set(0), index


def outlier_product(x, index, w: QuantizedWeight):
  """x[:, index] @ W[index, :] in float32: the outlier channels' share of a W8A8 matmul."""
  rows = w.values[index].astype(jnp.float32) * w.scales
  return jnp.dot(x[:, index].astype(jnp.float32), rows, preferred_element_type=jnp.float32)
