"""fp8 with delayed scaling (`model.train_precision=fp8_delayed`), as Transformer Engine trains.

Per-tensor e4m3 forward and e5m2 gradients, as `fp8`, but a tensor's scale comes from the
largest absolute maximum of its last H passes (`model.fp8_amax_history`), not from its own:
the scale is known before the tensor is, so no reduction over it has to finish before its
matmul can start. Values beyond the scale's range saturate to the type's largest value.
Where the history is still empty (the first step) the tensor's own maximum scales it.

Each projection keeps one `AmaxHistory` [3, H], newest first: rows input, weight, incoming
gradient. The forward pass writes the first two rows (the module's state after the pass,
as a router's bias). The gradient's maximum is only known in the backward pass, which cannot
write state: the matmul takes the history as an input and returns the maximum as that
input's cotangent (`gradient_history_cotangent`), and the train step writes it into the third
row (jaxpar/train/amax_histories.py) instead of treating it as a gradient. Used twice in one
backward pass, a projection would record the sum of its maxima: a larger scale, never an
overflow (the blocks fp8_delayed reaches use each projection once). Under microbatches each
microbatch rolls the histories once.

`low_precision_reference.reference_delayed_matmul` defines the numbers in plain jnp.
"""

import jax
import jax.numpy as jnp
from flax import nnx

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
NAME = "amax_history"  # a projection's history is the module attribute `<projection>_amax_history`


class AmaxHistory(nnx.Variable):
  """A projection's absolute maxima of its last passes, [3 (input, weight, gradient), H], newest
  first. Not a parameter: the optimizer never sees it; the checkpoint keeps it."""


def amax_history(precision: str, length: int) -> AmaxHistory | None:
  return AmaxHistory(jnp.zeros((3, length), jnp.float32)) if precision == "fp8_delayed" else None


def scale(history_row, current, qtype):
  """The scale of a tensor whose own absolute maximum is `current`: the row's largest (the
  tensor's own where the row is still empty) over the type's largest value."""
  past = jnp.max(history_row)
  amax = jnp.where(past > 0, past, current)
  return jnp.where(amax > 0, amax, 1.0) / float(jnp.finfo(qtype).max)


def saturate(a, s, qtype):
  bound = float(jnp.finfo(qtype).max)
  return jnp.clip(a / s, -bound, bound).astype(qtype)


def rolled(row, newest):
  """Rows [..., H] with `newest` [...] in front and their oldest entries dropped."""
  return jnp.concatenate([jnp.asarray(newest, row.dtype)[..., None], row[..., :-1]], axis=-1)


def _dot(a, b, contract):
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def delayed_matmul(x, w, history):
  """x [..., K] @ w [K, N] in f32 (x, w f32) under fp8_delayed with `history` [3, H] ->
  (the product, the history's first two rows rolled with x's and w's maxima)."""
  return _forward(x, w, history)[0]


def _forward(x, w, history):
  amax_x, amax_w = jnp.max(jnp.abs(x)), jnp.max(jnp.abs(w))
  sx, sw = scale(history[0], amax_x, E4M3), scale(history[1], amax_w, E4M3)
  vx, vw = saturate(x, sx, E4M3), saturate(w, sw, E4M3)
  y = _dot(vx, vw, ((x.ndim - 1,), (0,))) * (sx * sw)
  rows = jnp.stack([rolled(history[0], amax_x), rolled(history[1], amax_w)])
  return (y, rows), (vx, sx, vw, sw, history)


def _backward(saved, cotangents):
  vx, sx, vw, sw, history = saved
  g = cotangents[0]  # the rows are state, not a result anything is differentiated through
  amax_g = jnp.max(jnp.abs(g))
  sg = scale(history[2], amax_g, E5M2)
  vg = saturate(g, sg, E5M2)
  last, lead = g.ndim - 1, tuple(range(g.ndim - 1))
  dx = _dot(vg, vw, ((last,), (1,))) * (sg * sw)
  dw = _dot(vx, vg, (lead, lead)) * (sx * sg)
  return dx, dw, gradient_history_cotangent(history, amax_g)


def gradient_history_cotangent(history, amax_g):
  """What the backward pass returns for the history: zeros, the gradient's maximum at [2, 0]."""
  return jnp.zeros_like(history).at[2, 0].set(amax_g)


delayed_matmul.defvjp(_forward, _backward)

