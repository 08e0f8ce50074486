"""The gated delta rule in chunks (the WY / UT-transform form of the DeltaNet and Gated
DeltaNet papers): the XLA path, and what "auto" runs until Pallas kernels exist.

Inside a chunk each token's write u_i = beta_i (v_i - k_i @ S_before_i) depends linearly on
the chunk's earlier writes and on the state S0 entering the chunk, so all of them solve one
unit-lower-triangular system (G: the cumulative log-decay inside the chunk):

  u_i + sum_{j<i} beta_i (k_i . k_j) exp(G_i - G_j) u_j = beta_i v_i - beta_i exp(G_i) k_i @ S0

and the outputs and the next state are matmuls:

  o_i = exp(G_i) q_i @ S0 + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j
  S1 = exp(G_last) S0 + sum_j exp(G_last - G_j) outer(k_j, u_j)

Only S crosses chunks: a scan of L / C steps instead of L.

With a decay per key channel (Kimi Delta Attention: g and G carry a last axis Dk), each
exp(G_i - G_j) multiplies channel by channel inside the products over Dk, so the chunk's
pairwise terms are sums over [C, C, Dk] rather than [C, C] matmuls scaled afterwards, and
the decays applied to q, k and S0 are per channel. Every exponent is still a difference
G_i - G_j with j <= i (or G_last - G_j, or G_i): <= 0, so nothing overflows.

Packed sequences are masks, not a -inf decay (exp of differences of those is nan): tokens of
different sequences in a chunk do not interact, a token reads S0 only when no sequence starts
before it in the chunk, and S1 keeps S0 only when none starts in the chunk. Every exponent used
is <= 0; masked ones are replaced before exp, so their gradient is exactly zero.
"""

import jax.numpy as jnp
from jax import lax

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.linear_attention.reference import segment_starts


def _chunks(x, chunk, num_k_heads):
  """[B, L, H, ...] (L a multiple of chunk) -> [L // chunk, B, Hk, H // Hk, chunk, ...]:
  value heads grouped under their key head (key tensors get a group of 1)."""
  x = x.reshape(x.shape[0], x.shape[1] // chunk, chunk, num_k_heads, -1, *x.shape[3:])
  return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 4)


def _masked_exp(exponent, mask):
  """exp(exponent) where mask, else 0; a masked exponent (maybe large and positive) never reaches exp."""
  return jnp.exp(jnp.where(mask, exponent, -jnp.inf))


def _forward_substitution(lower, b):
  """x with (I + lower) x = b: `lower` [.., C, C] strictly lower-triangular, b [.., C, D]; one
  row per step (rows not yet solved are zero, so a whole row of `lower` may multiply x)."""
  def row(i, x):
    return x.at[..., i, :].set(b[..., i, :] - jnp.einsum("...j,...jd->...d", lower[..., i, :], x))
  return lax.fori_loop(0, b.shape[-2], row, jnp.zeros_like(b))


def solve_unit_lower(lower, b):
  """x with (I + lower) x = b, differentiable in both (lax.custom_linear_solve: the gradient
  solves the transposed system, reversed into lower-triangular form). Not LAPACK's trsm,
  which jax.scipy's solve_triangular calls on CPU: jaxlib's kernel splits a batch over the
  pool it runs on and waits for the pieces, so two solves at once on a two-thread pool wait
  for each other forever (seen on this 2-core host at 32 rows x 4 heads)."""
  reverse = lambda x: jnp.flip(x, axis=-2)  # noqa: E731
  upper_reversed = jnp.flip(lower.mT, axis=(-2, -1))  # (I + lower^T) reversed: unit lower
  return lax.custom_linear_solve(
      lambda x: x + lower @ x, b, solve=lambda _, rhs: _forward_substitution(lower, rhs),
      transpose_solve=lambda _, rhs: reverse(_forward_substitution(upper_reversed, reverse(rhs))))


def _chunk_terms(q, k, v, g, beta, starts):
  """The per-chunk quantities that do not depend on S0, for all chunks at once. Tokens: q, k
  [n, B, Hk, 1, C, Dk]; v [.., G, C, Dv]; g [n, B, Hk, G, C] or [.., C, Dk] (per channel),
  beta [n, B, Hk, G, C]; starts [n, B, C]."""
  chunk = beta.shape[-1]
  per_channel = g.ndim == beta.ndim + 1
  # Which packed sequence of the chunk a token is in: 0 for the one running in from before.
  seq = jnp.cumsum(starts, axis=-1)[:, :, None, None]
  same = seq[..., :, None] == seq[..., None, :]
  pos = jnp.arange(chunk)
  earlier, upto = same & (pos[:, None] > pos), same & (pos[:, None] >= pos)
  if per_channel:
    cum = jnp.cumsum(g, axis=-2)  # [.., C, Dk]
    gaps = cum[..., :, None, :] - cum[..., None, :, :]  # [.., C, C, Dk]: from token j to token i, per channel
    pairs = lambda a, mask: jnp.einsum("...ic,...jc,...ijc->...ij", a, k, _masked_exp(gaps, mask[..., None]))  # noqa: E731
    system, attn = beta[..., None] * pairs(k, earlier), pairs(q, upto)
    read_decay = _masked_exp(cum, (seq == 0)[..., None])  # per channel
    write_decay = _masked_exp(cum[..., -1:, :] - cum, (seq == seq[..., -1:])[..., None])
    carry_decay = _masked_exp(cum[..., -1, :], (seq[..., -1] == 0)[..., None])[..., :, None]
  else:
    cum = jnp.cumsum(g, axis=-1)
    gaps = cum[..., :, None] - cum[..., None, :]  # log-decay from token j to token i
    system = beta[..., None] * (k @ k.mT) * _masked_exp(gaps, earlier)
    attn = (q @ k.mT) * _masked_exp(gaps, upto)
    read_decay = _masked_exp(cum, seq == 0)[..., None]
    write_decay = _masked_exp(cum[..., -1:] - cum, seq == seq[..., -1:])[..., None]
    carry_decay = _masked_exp(cum[..., -1], seq[..., -1] == 0)[..., None, None]
  # One solve for both right-hand sides: the writes without S0 and what S0 takes off them.
  state_rhs = jnp.broadcast_to(beta[..., None] * read_decay * k, v.shape[:-1] + k.shape[-1:])
  rhs = jnp.concatenate([beta[..., None] * v, state_rhs], axis=-1)
  solved = solve_unit_lower(system, rhs)
  writes, state_reads = jnp.split(solved, [v.shape[-1]], axis=-1)
  return writes, state_reads, read_decay * q, attn, write_decay * k, carry_decay


def _chunk_step(state, terms):
  """One chunk against the state entering it: (state leaving it, out [B, Hk, G, C, Dv])."""
  writes, state_reads, read_queries, attn, write_keys, carry_decay = terms
  u = writes - state_reads @ state
  out = read_queries @ state + attn @ u
  return carry_decay * state + write_keys.mT @ u, out


def gated_delta_rule_chunked(q, k, v, g, beta, *, initial_state=None, segment_ids=None, chunk_size=64):
  """The gated delta rule of reference.py (same arguments and results), `chunk_size` tokens
  at a time (at most the sequence), in float32."""
  batch, length, num_k_heads, key_dim = k.shape
  num_heads, value_dim = v.shape[2:]
  out_dtype = v.dtype
  chunk = tiling.fit_block(chunk_size, length, 1)
  padded = tiling.round_up(length, chunk)
  # Padding tokens (g = beta = 0, zero vectors) neither decay nor write: outputs and state unchanged.
  starts = jnp.zeros((batch, length), bool) if segment_ids is None else segment_starts(segment_ids)
  q, k, v, g, beta, starts = (tiling.pad_axis(x, 1, padded) for x in (q, k, v, g, beta, starts))
  q, k, v, g, beta = (_chunks(x.astype(jnp.float32), chunk, num_k_heads) for x in (q, k, v, g, beta))
  starts = jnp.moveaxis(starts.reshape(batch, padded // chunk, chunk), 1, 0)
  state = jnp.zeros((batch, num_heads, key_dim, value_dim), jnp.float32)
  if initial_state is not None:
    state = initial_state.astype(jnp.float32)
  state = state.reshape(batch, num_k_heads, -1, key_dim, value_dim)
  state, out = lax.scan(_chunk_step, state, _chunk_terms(q, k, v, g, beta, starts))
  out = jnp.moveaxis(out, 0, 3).reshape(batch, num_heads, padded, value_dim)[:, :, :length]
  return jnp.swapaxes(out, 1, 2).astype(out_dtype), state.reshape(batch, num_heads, key_dim, value_dim)
