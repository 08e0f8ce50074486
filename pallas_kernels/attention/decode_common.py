"""Pieces shared by the paged attention paths: which cache pages a sequence can see, the
layer a decode kernel reads, and checks."""

import jax
import jax.numpy as jnp

from jaxpar.errors import UserError
from jaxpar.pallas_kernels.attention.validation import check_sinks


def visible_pages(page_table, q_positions, page_size, sliding_window):
  """The part of each row's page table that its queries can see through a sliding window.

  q_positions [B, T]: contiguous per row (negative: padding). -> (table [B, m], start [B]:
  the position of the table's first key), m = the pages a window of T queries can span
  (static). Without a window, or when m covers the whole table: the table itself, start 0.
  Pages before the window are never read, so a cache may hand them to other sequences.
  """
  batch, width = page_table.shape
  zeros = jnp.zeros((batch,), jnp.int32)
  if sliding_window is None:
    return page_table, zeros
  span = (q_positions.shape[1] + sliding_window - 2) // page_size + 2
  if span >= width:
    return page_table, zeros
  valid = q_positions >= 0
  lowest = jnp.min(jnp.where(valid, q_positions, jnp.iinfo(jnp.int32).max), axis=1)
  lowest = jnp.where(jnp.any(valid, axis=1), lowest, 0)
  highest = jnp.max(jnp.where(valid, q_positions, 0), axis=1)
  first = jnp.maximum(lowest - sliding_window + 1, 0) // page_size
  # Columns past the newest page repeat it (their keys lie after every query: masked), so
  # nothing outside the row's window is ever fetched, not even as padding.
  columns = jnp.minimum(first[:, None] + jnp.arange(span), (highest // page_size)[:, None])
  return jnp.take_along_axis(page_table, columns, axis=1), (first * page_size).astype(jnp.int32)


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


def stacked_inputs(q, k_pages, v_pages, lengths, page_table, layer, value_dim=None, sinks=None):
  """A decode kernel's pages as a pool stacked over layers [layers, Hkv, num_pages,
  page_size, D], read by the layer's index [1] int32 (slicing a layer out first would copy
  it), checked (`check_decode_args`) -> (k, v, layer, the values' head dim). layer None:
  the pages are one layer's, made a stack of one (a free reshape)."""
  if layer is None:
    k_pages, v_pages, layer = k_pages[None], None if v_pages is None else v_pages[None], 0
  one_layer = lambda pages: None if pages is None else jax.ShapeDtypeStruct(pages.shape[1:], pages.dtype)  # noqa: E731
  value_dim = check_decode_args(q, one_layer(k_pages), one_layer(v_pages), lengths, page_table, value_dim, sinks)
  return k_pages, v_pages, jnp.asarray(layer, jnp.int32).reshape(1), value_dim


def check_decode_args(q, k_pages, v_pages, lengths, page_table, value_dim=None, sinks=None) -> int:
  """q [B, Hq, D]; k pages [Hkv, num_pages, page_size, D]; v pages [.., Dv], or None when
  the values are the keys' first `value_dim` entries; lengths [B]; page_table [B, n];
  sinks [Hq] or None. Returns the values' head dim."""
  check_sinks(sinks, q.shape[1])
  if q.ndim != 3:
    raise UserError(f"q must be [batch, heads, head_dim] for decode, got shape {q.shape}")
  if k_pages.ndim != 4:
    raise UserError(f"k_cache must be [kv_heads, num_pages, page_size, head_dim], got {k_pages.shape}")
  if v_pages is None:
    if value_dim is None or not 0 < value_dim <= k_pages.shape[3]:
      raise UserError(f"without v_cache, value_dim={value_dim} must name how many leading entries of "
                       f"each key (head_dim {k_pages.shape[3]}) are its value")
  elif v_pages.ndim != 4 or v_pages.shape[:3] != k_pages.shape[:3]:
    raise UserError("k_cache and v_cache must both be [kv_heads, num_pages, page_size, head_dim], "
                     f"got {k_pages.shape} and {v_pages.shape}")
  if q.shape[1] % k_pages.shape[0]:
    raise UserError(f"q heads ({q.shape[1]}) must be a multiple of k/v heads ({k_pages.shape[0]})")
  if q.shape[2] != k_pages.shape[3]:
    raise UserError(f"head_dim={q.shape[2]} must match k_cache's ({k_pages.shape[3]})")
  if lengths.shape != q.shape[:1]:
    raise UserError(f"lengths must be [batch] = {q.shape[:1]}, got {lengths.shape}")
  if page_table.ndim != 2 or page_table.shape[0] != q.shape[0]:
    raise UserError(f"page_table must be [batch, pages_per_sequence], got {page_table.shape}")
  return value_dim if v_pages is None else v_pages.shape[3]
