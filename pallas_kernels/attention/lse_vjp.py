"""The custom VJP every attention implementation here shares: save the output and the
log-sum-exp of the forward, and let the backward recompute the probabilities from them.
The kernels use it per call; ring and all-gather context parallelism around a whole
sequence split over devices."""

import functools

import jax


def with_lse_vjp(forward, backward):
  """forward(st, q, k, v, *masks) -> (o, lse);
  backward(st, q, k, v, *masks, o, lse, do) -> (dq, dk, dv).
  masks: what shapes the mask and has no gradient (segment ids, offsets; None allowed).
  Returns attend(st, q, k, v, *masks) -> o with that VJP; `st` is static."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def attend(st, q, k, v, *masks):
    return forward(st, q, k, v, *masks)[0]

  def attend_fwd(st, q, k, v, *masks):
    o, lse = forward(st, q, k, v, *masks)
    return o, (q, k, v, masks, o, lse)

  def attend_bwd(st, residuals, do):
    q, k, v, masks, o, lse = residuals
    return (*backward(st, q, k, v, *masks, o, lse, do), *(None,) * len(masks))

  attend.defvjp(attend_fwd, attend_bwd)
  return attend
