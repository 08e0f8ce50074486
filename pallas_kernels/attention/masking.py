"""Masking and soft-capping shared by every attention kernel and the chunked path: a mask
object (spec.py) turned into tile masks and the ranges of tiles worth visiting.

Positions are token indices into the keys; query i sits at `q_offset + i` (the last
q_len of kv_len positions in plain attention; anywhere, even before key 0, when a
context-parallel block pairs queries and keys from different devices). Everything here
works on traced scalars, numpy ints and broadcastable arrays, so the same code builds a
[bq, bk] tile mask inside a kernel and decides which tiles to skip.
"""

import jax.numpy as jnp
import numpy as np

# Finite, so a tile that is fully masked for a row gives exp(0)=1 instead of NaN;
# the next live tile's larger running max zeroes those terms out.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def soft_cap(logits, cap):
  """Gemma-style logit soft-capping: cap * tanh(logits / cap)."""
  return logits if cap is None else cap * jnp.tanh(logits / cap)


def soft_cap_grad(capped, cap):
  """d capped / d logits, written in terms of the capped logits (tanh' = 1 - tanh^2)."""
  return 1.0 if cap is None else 1.0 - jnp.square(capped / cap)


def token_mask(q_pos, k_pos, mask, *, kv_len, q_seg=None, k_seg=None):
  """True where the query at q_pos may see the key at k_pos under `mask` (a spec.Mask;
  broadcasting); keys past kv_len are block padding; segments, when given, must match."""
  seen = k_pos < kv_len
  if mask.causal:
    seen = seen & (k_pos <= q_pos)
  if mask.window is not None:
    seen = seen & (q_pos - k_pos < mask.window)
  if q_seg is not None:
    seen = seen & (q_seg == k_seg)
  return seen


def first_live_key(q_lo, mask):
  """Smallest key position any query >= q_lo may see (ignoring segments)."""
  if mask.window is None:
    return 0
  return jnp.maximum(q_lo - mask.window + 1, 0)


def last_live_key(q_hi, mask, *, kv_len):
  """Largest key position any query <= q_hi may see (ignoring segments)."""
  return jnp.minimum(q_hi, kv_len - 1) if mask.causal else kv_len - 1


def kv_block_range(q_lo, q_hi, block_k, mask, *, kv_len):
  """[first, last] kv block indices that can hold a visible key for queries q_lo..q_hi
  (first > last: none; then last may be -1)."""
  first = first_live_key(q_lo, mask) // block_k
  last_key = last_live_key(q_hi, mask, kv_len=kv_len)
  # Queries entirely before key 0 see nothing; keep the division on non-negative numbers.
  last = jnp.where(last_key < 0, -1, jnp.maximum(last_key, 0) // block_k)
  return first, last


def q_block_range(k_lo, k_hi, block_q, num_q_blocks, mask, *, q_offset):
  """[first, last] q block indices (of num_q_blocks) whose queries can see keys k_lo..k_hi
  (first > last: none; then last may be -1)."""
  first_pos = k_lo if mask.causal else q_offset  # causal: only queries at or after the key
  last_pos = num_q_blocks * block_q - 1 + q_offset
  if mask.window is not None:
    last_pos = jnp.minimum(last_pos, k_hi + mask.window - 1)
  first = jnp.clip(first_pos - q_offset, 0, None) // block_q
  last_q = last_pos - q_offset
  last = jnp.where(last_q < 0, -1, jnp.maximum(last_q, 0) // block_q)
  return first, last
