"""Pure-jnp attention: the readable definition every kernel is tested against."""

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


def attention_reference(q, k, v, *, causal=True, segment_ids=None, sliding_window=None,
                        logit_soft_cap=None, scale=None):
  """Softmax attention. q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D]; Hq % Hkv == 0 (GQA).

  segment_ids: optional int [B, Lk]; tokens attend only within their own segment
  (packed sequences). Returns [B, Lq, Hq, D] in q's dtype; softmax runs in float32.
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
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
