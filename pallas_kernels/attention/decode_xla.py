"""Paged decode attention for XLA's own backends (CPU), laid out so the page gather is a
plain block copy.

The reference gathers each sequence's pages as [B, L, Hkv, D] and multiplies queries by
keys with the keys on the right, which XLA's CPU dot wants contraction-major: it fuses the
gather with a full transpose to [B, Hkv, D, L], an element-by-element scatter of every key.
Here pages are gathered as [B, Hkv, L, D] (whole [page_size, D] blocks, in order) and keys
are the left operand, contracted on their last axis, so no key is transposed; values were
already in the order their product wants. The scores come out [B, Hkv, G, L], keys on the
minor axis, so the softmax reduces along contiguous memory: over [.., L, G] (G = 1 with
multi-head attention) XLA's CPU reductions took ten times as long. Same result as
`decode_attention_reference` (tests compare them).
"""

import jax
import jax.numpy as jnp


def _sequences(pages, page_table):
  """[Hkv, num_pages, page_size, D] pages + [B, n] table -> [B, Hkv, n * page_size, D]."""
  batch, count = page_table.shape
  num_kv_heads, _, page_size, head_dim = pages.shape
  return jnp.moveaxis(pages[:, page_table], 0, 1).reshape(batch, num_kv_heads, count * page_size, head_dim)


def _softmax_over_keys(logits, sinks):
  """Softmax over the last axis of [B, Hkv, G, L]; sinks [Hq] join each row as one more key."""
  if sinks is None:
    return jax.nn.softmax(logits, axis=-1)
  batch, num_kv_heads, group, _ = logits.shape
  column = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1),
                            (batch, num_kv_heads, group, 1))
  return jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]


def paged_decode_attention_xla(q, k_pages, v_pages, lengths, page_table, *, sliding_window=None,
                               logit_soft_cap=None, scale=None, value_dim=None, sinks=None):
  """q [B, Hq, D]; k pages [Hkv, num_pages, page_size, D], v pages [.., Dv] or None with
  `value_dim` (the keys' first entries: a latent cache); lengths [B] (the new token's key
  included); page_table [B, n]; sinks [Hq] or None -> [B, Hq, Dv]; length 0 gets 0."""
  batch, num_heads, head_dim = q.shape
  keys = _sequences(k_pages, page_table)
  values = keys[..., :value_dim] if v_pages is None else _sequences(v_pages, page_table)
  scale = head_dim ** -0.5 if scale is None else scale
  qg = q.reshape(batch, keys.shape[1], num_heads // keys.shape[1], head_dim)
  logits = jnp.einsum("bhkd,bhgd->bhgk", keys, qg, preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
  position = jnp.arange(keys.shape[2])[None, :]
  mask = position < lengths[:, None]
  if sliding_window is not None:
    mask &= lengths[:, None] - 1 - position < sliding_window
  mask = mask[:, None, None, :]  # [B, 1, 1, L]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jnp.where(mask, _softmax_over_keys(logits, sinks), 0.0)
  out = jnp.einsum("bhgk,bhkd->bhgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
  return out.reshape(batch, num_heads, values.shape[-1]).astype(q.dtype)
