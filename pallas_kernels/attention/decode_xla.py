"""Paged decode attention for XLA's own backends (CPU), laid out so the page gather is a
plain block copy.

The reference gathers each sequence's pages as [B, L, Hkv, D] and multiplies queries by
keys with the keys on the right, which XLA's CPU dot wants contraction-major: it fuses the
gather with a full transpose to [B, Hkv, D, L], an element-by-element scatter of every key.
Here pages are gathered as [B, Hkv, L, D] (whole [page_size, D] blocks, in order) and keys
are the left operand, contracted on their last axis, so no key is transposed; values were
already in the order their product wants. With one query per kv head (multi-head
attention) the scores come out [B, Hkv, 1, L], a free view, so the softmax reduces along
contiguous memory: over [B, Hkv, L, 1] XLA's CPU reductions took ten times as long. With
grouped queries they stay [B, Hkv, L, G]: the other order measured no faster there. Same
result as `decode_attention_reference` (tests compare them).
"""

import jax
import jax.numpy as jnp

from jaxpar.pallas_kernels.attention.spec import AttentionSpec


def _sequences(pages, page_table):
  """[Hkv, num_pages, page_size, D] pages + [B, n] table -> [B, Hkv, n * page_size, D]."""
  batch, count = page_table.shape
  num_kv_heads, _, page_size, head_dim = pages.shape
  return jnp.moveaxis(pages[:, page_table], 0, 1).reshape(batch, num_kv_heads, count * page_size, head_dim)


def _softmax_over_keys(logits, sinks, axis):
  """Softmax over the keys' `axis` of [B, Hkv, G, L] or [B, Hkv, L, G]; sinks [Hq] join each
  row as one more key."""
  if sinks is None:
    return jax.nn.softmax(logits, axis=axis)
  column_shape = list(logits.shape)
  column_shape[axis] = 1
  column = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, *column_shape[1:]), column_shape)
  probs = jax.nn.softmax(jnp.concatenate([logits, column], axis=axis), axis=axis)
  return jax.lax.slice_in_dim(probs, 0, logits.shape[axis], axis=axis)


def paged_decode_attention_xla(q, k_pages, v_pages, lengths, page_table, spec: AttentionSpec = AttentionSpec(), *,
                               sinks=None):
  """q [B, Hq, D]; k pages [Hkv, num_pages, page_size, D], v pages [.., Dv] or None with
  spec.value_dim (the keys' first entries: a latent cache); lengths [B] (the new token's key
  included); page_table [B, n]; sinks [Hq] or None -> [B, Hq, Dv]; length 0 gets 0."""
  batch, num_heads, head_dim = q.shape
  keys = _sequences(k_pages, page_table)
  values = keys[..., :spec.value_dim] if v_pages is None else _sequences(v_pages, page_table)
  scale, logit_soft_cap, sliding_window = spec.scale_for(head_dim), spec.logit_soft_cap, spec.sliding_window
  group = num_heads // keys.shape[1]
  qg = q.reshape(batch, keys.shape[1], group, head_dim)
  scores = "bhgk" if group == 1 else "bhkg"  # the module docstring says why
  axis = scores.index("k")
  logits = jnp.einsum(f"bhkd,bhgd->{scores}", keys, qg, preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
  position = jnp.arange(keys.shape[2])[None, :]
  mask = position < lengths[:, None]
  if sliding_window is not None:
    mask &= lengths[:, None] - 1 - position < sliding_window
  mask = jnp.expand_dims(mask, (1, 2) if axis == 3 else (1, 3))  # like the scores: [B, 1, 1, L] or [B, 1, L, 1]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jnp.where(mask, _softmax_over_keys(logits, sinks, axis), 0.0)
  out = jnp.einsum(f"{scores},bhkd->bhgd", probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
  return out.reshape(batch, num_heads, values.shape[-1]).astype(q.dtype)
