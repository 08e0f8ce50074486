"""The custom VJP every attention implementation here shares: save the output and the
log-sum-exp of the forward, and let the backward recompute the probabilities from them.
The kernels use it per call; ring and all-gather context parallelism around a whole
sequence split over devices.

Attention sinks (a logit per query head that joins each row's softmax with a zero value)
live in the forward's log-sum-exp, so the backward kernels need nothing new: their
probabilities exp(s - lse) already carry the sink's share of each row. The sinks' own
gradient is the sink column's softmax derivative, -exp(sink - lse) * rowsum(o * do),
summed over rows: plain jnp here, for every implementation.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax


def sink_gradient(sinks, o, lse, do):
  """d loss / d sinks [H] from the output o, cotangent do [B, L, H, D] and lse [B, H, L]."""
  if sinks is None:
    return None
  delta = jnp.einsum("blhd,blhd->bhl", o.astype(jnp.float32), do.astype(jnp.float32))
  share = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
  grad = -jnp.sum(share * delta, axis=(0, 2))
  # Inside shard_map each device sums its own rows (its batch, its piece of the sequence);
  # the sinks are the same on those devices, so their gradient is the sum over them.
  spread = tuple(sorted(set(jax.typeof(grad).mat.varying) - set(jax.typeof(sinks).mat.varying)))
  return (lax.psum(grad, spread) if spread else grad).astype(sinks.dtype)


def with_lse_vjp(forward, backward):
  """forward(st, q, k, v, sinks, *masks) -> (o, lse);
  backward(st, q, k, v, *masks, o, lse, do) -> (dq, dk, dv).
  sinks: [Hq] or None. masks: what shapes the mask and has no gradient (segment ids,
  offsets; None allowed). Returns attend(st, q, k, v, sinks, *masks) -> o with that VJP;
  `st` is static."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attend(st, q, k, v, sinks, *masks):
    return forward(st, q, k, v, sinks, *masks)[0]

  def attend_fwd(st, q, k, v, sinks, *masks):
    o, lse = forward(st, q, k, v, sinks, *masks)
    return o, (q, k, v, sinks, masks, o, lse)

  def attend_bwd(st, residuals, do):
    q, k, v, sinks, masks, o, lse = residuals
    dq, dk, dv = backward(st, q, k, v, *masks, o, lse, do)
    return (dq, dk, dv, sink_gradient(sinks, o, lse, do), *(None,) * len(masks))

  attend.defvjp(attend_fwd, attend_bwd)
  return attend
