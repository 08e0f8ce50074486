"""Pure-jnp attention: the readable definition every kernel is tested against.

Attention sinks (GPT-OSS): one learned logit per query head that joins every row's
softmax as an extra column whose value is zero, so a query may put weight on nothing.
"""

import jax
import jax.numpy as jnp


def attention_mask(q_len, kv_len, *, causal, segment_ids=None, sliding_window=None):
  """Boolean [B or 1, 1, q_len, kv_len] mask: True where a query may attend to a key.

  Queries are the last `q_len` positions of the `kv_len` keys (so q_len == kv_len in
  training, and a prefix of cached keys otherwise).
  """
  q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
  k_pos = jnp.arange(kv_len)[None, :]
  mask = jnp.ones((q_len, kv_len), dtype=bool)
  if causal:
    mask &= k_pos <= q_pos
  if sliding_window is not None:
    mask &= q_pos - k_pos < sliding_window
  mask = mask[None, None]
  if segment_ids is not None:
    q_seg = segment_ids[:, -q_len:]
    mask = mask & (q_seg[:, None, :, None] == segment_ids[:, None, None, :])
  return mask


def softmax(logits, sinks=None):
  """Softmax over the last axis of logits [B, Hkv, G, ..., K]; with sinks [Hq] (Hq = Hkv * G)
  each row gets one more column, its head's sink, which is dropped after normalising."""
  if sinks is None:
    return jax.nn.softmax(logits, axis=-1)
  num_kv_heads, group = logits.shape[1:3]
  column = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, *[1] * (logits.ndim - 3))
  column = jnp.broadcast_to(column, logits.shape[:-1] + (1,))
  return jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]


def attention_reference(q, k, v, *, causal=True, segment_ids=None, sliding_window=None,
                        logit_soft_cap=None, scale=None, sinks=None):
  """Softmax attention. q, k: [B, Lq | Lk, Hq | Hkv, D]; v: [B, Lk, Hkv, Dv] (Dv may differ
  from D: multi-head latent attention); Hq % Hkv == 0 (GQA).

  segment_ids: optional int [B, Lk]; tokens attend only within their own segment
  (packed sequences). sinks: optional [Hq] logits (module doc). Returns [B, Lq, Hq, Dv] in
  q's dtype; softmax runs in float32.
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  # Group query heads by their kv head instead of repeating K/V.
  qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
  mask = attention_mask(q_len, kv_len, causal=causal, segment_ids=segment_ids,
                        sliding_window=sliding_window)
  logits = jnp.where(mask[:, :, None], logits, jnp.finfo(jnp.float32).min)
  probs = softmax(logits, sinks)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, v.shape[-1]).astype(q.dtype)


def gather_pages(pages, page_table):
  """Paged cache [Hkv, num_pages, page_size, D] + page_table [B, n] -> [B, n * page_size, Hkv, D]."""
  num_kv_heads, _, page_size, head_dim = pages.shape
  batch, pages_per_seq = page_table.shape
  seq = pages[:, page_table]  # [Hkv, B, n, page_size, D]
  return seq.reshape(num_kv_heads, batch, pages_per_seq * page_size, head_dim).transpose(1, 2, 0, 3)


def shared_values(k, v, value_dim):
  """The values: `v`, or when None the first `value_dim` entries of each key (a latent
  cache, as multi-head latent attention's absorbed form reads it: one array holds both)."""
  return k[..., :value_dim] if v is None else v


def decode_attention_reference(q, k_cache, v_cache, lengths, *, page_table=None,
                               sliding_window=None, logit_soft_cap=None, scale=None, value_dim=None,
                               sinks=None):
  """One new query token per sequence against a KV cache with ragged lengths.

  q: [B, Hq, D]; lengths: int [B], the valid cache entries per sequence (the new
  token's own key included, at position lengths - 1). The cache is contiguous
  k [B, S, Hkv, D], v [B, S, Hkv, Dv], or paged: k [Hkv, num_pages, page_size, D],
  v [.., Dv] with page_table int [B, pages_per_seq]; v None: the values are the keys'
  first `value_dim` entries. Returns [B, Hq, Dv]; sequences with length 0 get 0.
  """
  if page_table is not None:
    k_cache = gather_pages(k_cache, page_table)
    v_cache = None if v_cache is None else gather_pages(v_cache, page_table)
  v_cache = shared_values(k_cache, v_cache, value_dim)
  batch, num_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[2]
  scale = head_dim ** -0.5 if scale is None else scale
  qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
  logits = jnp.einsum("bhgd,bkhd->bhgk", qg, k_cache, preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
  k_pos = jnp.arange(k_cache.shape[1])[None, :]
  mask = k_pos < lengths[:, None]
  if sliding_window is not None:
    mask &= lengths[:, None] - 1 - k_pos < sliding_window
  logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jnp.where(mask[:, None, None], softmax(logits, sinks), 0.0)
  out = jnp.einsum("bhgk,bkhd->bhgd", probs.astype(v_cache.dtype), v_cache,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, num_heads, v_cache.shape[-1]).astype(q.dtype)


def paged_attention_reference(q, k_pages, v_pages, q_positions, page_table, *,
                              sliding_window=None, logit_soft_cap=None, scale=None, value_dim=None,
                              sinks=None):
  """Several new query tokens per sequence against a paged cache holding their keys.

  q: [B, T, Hq, D] at q_positions int [B, T]; a query at position p sees the cached keys
  at positions 0..p (within `sliding_window` of p). Negative positions are padding and
  get 0. Pages: k [Hkv, num_pages, page_size, D], v [.., Dv] (None: the keys' first
  `value_dim` entries); page_table: int [B, pages_per_seq]. -> [B, T, Hq, Dv].
  """
  k = gather_pages(k_pages, page_table)
  v = shared_values(k, None if v_pages is None else gather_pages(v_pages, page_table), value_dim)
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  scale = head_dim ** -0.5 if scale is None else scale
  qg = q.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
  logits = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
  if logit_soft_cap is not None:
    logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
  k_pos = jnp.arange(k.shape[1])[None, None, :]
  q_pos = q_positions[:, :, None]
  mask = k_pos <= q_pos
  if sliding_window is not None:
    mask &= q_pos - k_pos < sliding_window
  mask = mask[:, None, None]  # [B, 1, 1, T, S]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jnp.where(mask, softmax(logits, sinks), 0.0)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, v.shape[-1]).astype(q.dtype)
