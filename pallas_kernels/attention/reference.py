"""Pure-jnp attention: the readable definition every kernel is tested against.

Attention sinks (GPT-OSS): one learned logit per query head that joins every row's
softmax as an extra column whose value is zero, so a query may put weight on nothing.
"""

import jax
import jax.numpy as jnp

from jaxpar.pallas_kernels.attention.spec import AttentionSpec, TreeMask


def visible(mask, q_pos, k_pos):
  """True where a query at q_pos may see the key at k_pos under `mask` (a spec.Mask)."""
  seen = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), bool)
  if mask.causal:
    seen &= k_pos <= q_pos
  if mask.window is not None:
    seen &= q_pos - k_pos < mask.window
  return seen


def tree_visible(mask, q_positions, k_pos):
  """[B, T, S]: where query i of a tree pass (at slot q_positions[:, i], the root's plus i)
  may see the key at slot k_pos under a TreeMask: every key before the root, and of the
  pass's own keys its ancestors and itself."""
  index = jnp.arange(q_positions.shape[1])[None, :, None]
  among = k_pos - (q_positions[:, :, None] - index)  # the key's index in the pass (< 0: cached before it)
  inside = (among >= 0) & (among < q_positions.shape[1])
  ancestry = jnp.asarray(mask.ancestry())[jnp.broadcast_to(index, among.shape), jnp.clip(among, 0, q_positions.shape[1] - 1)]
  return (among < 0) | (inside & ancestry)


def attention_mask(q_len, kv_len, mask, segment_ids=None):
  """Boolean [B or 1, 1, q_len, kv_len] mask: True where a query may attend to a key.

  Queries are the last `q_len` positions of the `kv_len` keys (so q_len == kv_len in
  training, and a prefix of cached keys otherwise).
  """
  q_pos = jnp.arange(q_len)[:, None] + (kv_len - q_len)
  mask = visible(mask, q_pos, jnp.arange(kv_len)[None, :])[None, None]
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


def _logits(spec, qg, k, equation):
  """Scaled, soft-capped logits in float32."""
  logits = jnp.einsum(equation, qg, k, preferred_element_type=jnp.float32) * spec.scale_for(qg.shape[-1])
  cap = spec.logit_soft_cap
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def attention_reference(q, k, v, spec: AttentionSpec = AttentionSpec(), *, segment_ids=None, sinks=None):
  """Softmax attention as `spec` says. q, k: [B, Lq | Lk, Hq | Hkv, D]; v: [B, Lk, Hkv, Dv]
  (Dv may differ from D: multi-head latent attention); Hq % Hkv == 0 (GQA).

  segment_ids: optional int [B, Lk]; tokens attend only within their own segment
  (packed sequences). sinks: optional [Hq] logits (module doc). Returns [B, Lq, Hq, Dv] in
  q's dtype; softmax runs in float32.
  """
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  # Group query heads by their kv head instead of repeating K/V.
  qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
  logits = _logits(spec, qg, k, "bqhgd,bkhd->bhgqk")
  mask = attention_mask(q_len, kv_len, spec.mask, segment_ids)
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


def decode_attention_reference(q, k_cache, v_cache, lengths, spec: AttentionSpec = AttentionSpec(), *,
                               page_table=None, sinks=None):
  """One new query token per sequence against a KV cache with ragged lengths.

  q: [B, Hq, D]; lengths: int [B], the valid cache entries per sequence (the new
  token's own key included, at position lengths - 1). The cache is contiguous
  k [B, S, Hkv, D], v [B, S, Hkv, Dv], or paged: k [Hkv, num_pages, page_size, D],
  v [.., Dv] with page_table int [B, pages_per_seq]; v None: the values are the keys'
  first spec.value_dim entries. Returns [B, Hq, Dv]; sequences with length 0 get 0.
  """
  if page_table is not None:
    k_cache = gather_pages(k_cache, page_table)
    v_cache = None if v_cache is None else gather_pages(v_cache, page_table)
  v_cache = shared_values(k_cache, v_cache, spec.value_dim)
  batch, num_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[2]
  qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
  logits = _logits(spec, qg, k_cache, "bhgd,bkhd->bhgk")
  k_pos = jnp.arange(k_cache.shape[1])[None, :]
  mask = (k_pos < lengths[:, None]) & visible(spec.mask, lengths[:, None] - 1, k_pos)
  logits = jnp.where(mask[:, None, None], logits, jnp.finfo(jnp.float32).min)
  probs = jnp.where(mask[:, None, None], softmax(logits, sinks), 0.0)
  out = jnp.einsum("bhgk,bkhd->bhgd", probs.astype(v_cache.dtype), v_cache,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, num_heads, v_cache.shape[-1]).astype(q.dtype)


def paged_attention_reference(q, k_pages, v_pages, q_positions, page_table, spec: AttentionSpec = AttentionSpec(),
                              *, sinks=None):
  """Several new query tokens per sequence against a paged cache holding their keys.

  q: [B, T, Hq, D] at q_positions int [B, T]; a query at position p sees the cached keys
  at positions 0..p, as spec.mask says (causal: never a key after p). Negative positions
  are padding and get 0. Pages: k [Hkv, num_pages, page_size, D], v [.., Dv] (None: the
  keys' first spec.value_dim entries); page_table: int [B, pages_per_seq]. -> [B, T, Hq, Dv].
  """
  k = gather_pages(k_pages, page_table)
  v = shared_values(k, None if v_pages is None else gather_pages(v_pages, page_table), spec.value_dim)
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  qg = q.reshape(batch, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
  logits = _logits(spec, qg, k, "bqhgd,bkhd->bhgqk")
  k_pos = jnp.arange(k.shape[1])[None, None, :]
  q_pos = q_positions[:, :, None]
  mask = (k_pos <= q_pos) & visible(spec.mask, q_pos, k_pos)  # cached keys stop at the query
  if isinstance(spec.mask, TreeMask):
    mask &= tree_visible(spec.mask, q_positions, k_pos)
  mask = mask[:, None, None]  # [B, 1, 1, T, S]
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jnp.where(mask, softmax(logits, sinks), 0.0)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, v.shape[-1]).astype(q.dtype)
