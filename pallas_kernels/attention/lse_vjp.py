"""The custom VJP every attention implementation here shares: save the output and the
log-sum-exp of the forward, and let the backward recompute the probabilities from them."""

import functools

import jax


def with_lse_vjp(forward, backward):
  """forward(st, q, k, v, q_seg, kv_seg) -> (o, lse);
  backward(st, q, k, v, q_seg, kv_seg, o, lse, do) -> (dq, dk, dv).
  Returns attend(st, q, k, v, q_seg, kv_seg) -> o with that VJP; `st` is static."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attend(st, q, k, v, q_seg, kv_seg):
    return forward(st, q, k, v, q_seg, kv_seg)[0]

  def attend_fwd(st, q, k, v, q_seg, kv_seg):
    o, lse = forward(st, q, k, v, q_seg, kv_seg)
    return o, (q, k, v, q_seg, kv_seg, o, lse)

  def attend_bwd(st, residuals, do):
    return (*backward(st, *residuals, do), None, None)  # segment ids have no gradient

  attend.defvjp(attend_fwd, attend_bwd)
  return attend
