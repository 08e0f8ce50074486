"""Pure-jnp gated delta rule (Gated DeltaNet, the "linear attention" of Qwen3-Next): the
readable definition, one token at a time, that every faster form is tested against.

Per batch row and value head the state S [Dk, Dv] is a fast-weight memory from keys to
values. Each token decays it by exp(g), then writes the part of v that S does not already
predict for k (the delta rule), at rate beta, and reads it with q:

  S <- exp(g) * S;  S <- S + outer(k, beta * (v - k @ S));  o = q @ S

Consecutive value heads share a key head (head h reads key head h // (Hv // Hk)). q and k
are used as given: the model block normalises and scales them. The decay g is one number per
head and token (Gated DeltaNet), or one per key channel (Kimi Delta Attention: g [..., Dk],
each row of S decays by its own exp(g_c)).
"""

import jax
import jax.numpy as jnp


def segment_starts(segment_ids):
  """Bool [B, L]: True where a new packed sequence starts (its id differs from the token
  before), so the state resets there; never at a row's first token (it reads the initial state)."""
  changed = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros((segment_ids.shape[0], 1), bool), changed], axis=1)


def decay_rows(g):
  """exp(g) shaped to scale a state [.., Dk, Dv]: g [.., H] (per head) or [.., H, Dk] (per key channel)."""
  decay = jnp.exp(g.astype(jnp.float32))
  return decay[..., None] if decay.ndim == 3 else decay[..., None, None]


def gated_delta_step(state, q, k, v, g, beta):
  """One token (the decode step). state [B, Hv, Dk, Dv] (float32); q, k [B, Hk, Dk];
  v [B, Hv, Dv]; g [B, Hv] or [B, Hv, Dk]; beta [B, Hv] -> (out [B, Hv, Dv] in v's dtype,
  new state float32)."""
  group = v.shape[1] // k.shape[1]
  q, k = (jnp.repeat(x.astype(jnp.float32), group, axis=1) for x in (q, k))
  state = decay_rows(g) * state.astype(jnp.float32)
  error = v.astype(jnp.float32) - jnp.einsum("bhk,bhkv->bhv", k, state)
  state = state + k[..., :, None] * (beta.astype(jnp.float32)[..., None] * error)[..., None, :]
  return jnp.einsum("bhk,bhkv->bhv", q, state).astype(v.dtype), state


def gated_delta_rule_reference(q, k, v, g, beta, *, initial_state=None, segment_ids=None):
  """q, k [B, L, Hk, Dk]; v [B, L, Hv, Dv]; g (log-decay, <= 0) [B, L, Hv] or [B, L, Hv, Dk],
  beta [B, L, Hv];
  initial_state [B, Hv, Dk, Dv] or None (zeros); segment_ids int [B, L] or None (the state
  resets to zero where a packed sequence starts) -> (out [B, L, Hv, Dv] in v's dtype,
  final state [B, Hv, Dk, Dv] float32). A scan over time, in float32."""
  batch, length, num_heads, value_dim = v.shape
  state = jnp.zeros((batch, num_heads, k.shape[-1], value_dim), jnp.float32)
  if initial_state is not None:
    state = initial_state.astype(jnp.float32)
  starts = jnp.zeros((batch, length), bool) if segment_ids is None else segment_starts(segment_ids)

  def step(state, token):
    start, *inputs = token
    state = jnp.where(start[:, None, None, None], 0.0, state)
    out, state = gated_delta_step(state, *inputs)
    return state, out

  time_major = [jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta)]
  state, out = jax.lax.scan(step, state, (starts.T, *time_major))
  return jnp.moveaxis(out, 0, 1).astype(v.dtype), state
