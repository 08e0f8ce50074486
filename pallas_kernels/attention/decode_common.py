"""Pieces shared by the decode kernels: which cache pages a sequence can see, and checks."""

import jax.numpy as jnp

from jaxpar.errors import UserError


def live_pages(length, page_size, sliding_window):
  """[first, last] pages holding keys the new token sees (last = -1 for an empty sequence)."""
  last = (length - 1) // page_size
  if sliding_window is None:
    return 0, last
  return jnp.maximum(length - sliding_window, 0) // page_size, last


def clamp_page(j, length, page_size, sliding_window):
  """Page to fetch at step j: dead steps re-use a live page, so no new DMA is issued."""
  first, last = live_pages(length, page_size, sliding_window)
  return jnp.minimum(jnp.maximum(j, first), jnp.maximum(last, 0))


def check_decode_args(q, k_pages, v_pages, lengths, page_table, head_dims):
  """q [B, Hq, D]; pages [Hkv, num_pages, page_size, D]; lengths [B]; page_table [B, n]."""
  if q.ndim != 3:
    raise UserError(f"q must be [batch, heads, head_dim] for decode, got shape {q.shape}")
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
    raise UserError("k_cache and v_cache must both be [kv_heads, num_pages, page_size, head_dim], "
                     f"got {k_pages.shape} and {v_pages.shape}")
  if q.shape[1] % k_pages.shape[0]:
    raise UserError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k_pages.shape[0]})")
  if q.shape[2] != k_pages.shape[3] or q.shape[2] not in head_dims:
    raise UserError(f"head_dim={q.shape[2]} (k_cache: {k_pages.shape[3]}) must match and be one "
                     f"of {head_dims}")
  if lengths.shape != q.shape[:1]:
    raise UserError(f"lengths must be [batch] = {q.shape[:1]}, got {lengths.shape}")
  if page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
    raise UserError(f"page_table must be [batch, pages_per_sequence], got {page_table.shape}")
