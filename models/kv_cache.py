"""The paged KV cache a model's attention reads and writes during generation.

Per layer, keys and values live in pages `[kv_heads, num_pages, page_size, head_dim]`
(the layout the paged decode kernels read); a sequence's `page_table` row lists its pages
in order, so position p is slot p % page_size of page page_table[p // page_size]. A
contiguous cache is the special case of one page per sequence. Caches are stacked over
layers like the weights, and carry logical names so they shard like the model (kv heads
over `tensor`).

`PagedCache` is this layout as a cache kind (models/caches.py): attention calls its
`update_and_attend`, which writes the new keys and values, then reads them back through
the paged kernels.
"""

import jax
import jax.numpy as jnp
from flax import struct

from jaxpar import pallas_kernels

# Logical names of one layer's k or v pages, and of the stacked cache.
PAGE_NAMES = ("cache_kv_heads", "cache_pages", None, "head_dim")
STACKED_NAMES = ("layers",) + PAGE_NAMES


def head_repeat(cfg, split: int) -> int:
  """Copies of each KV head a generation cache keeps when its heads are split `split` ways
  (the devices `cache_kv_heads` maps to). With more devices than KV heads the heads would
  not divide, so every device would hold the whole cache; repeated `split / kv_heads` times
  (when the query heads split as evenly) each device holds the one head its query heads
  read: 1/kv_heads of the cache instead of all of it."""
  kv = cfg.num_kv_heads
  return split // kv if split > kv and split % kv == 0 and cfg.num_heads % split == 0 else 1


def fit_heads(x, heads: int):
  """New keys or values [B, T, kv_heads, D] repeated to the cache's `heads` (head_repeat):
  stored head j is KV head j // repeat, which query head h reads as h // (H / heads)."""
  return x if x.shape[2] == heads else jnp.repeat(x, heads // x.shape[2], axis=2)


def page_shape(cfg, num_pages: int, page_size: int) -> tuple[int, ...]:
  return (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)


def init_pages(cfg, num_layers: int, num_pages: int, page_size: int, dtype) -> dict:
  """A zeroed stacked cache {"k", "v"}: [num_layers, kv_heads, num_pages, page_size, head_dim]."""
  shape = (num_layers,) + page_shape(cfg, num_pages, page_size)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


@struct.dataclass
class PagedCache:
  """One layer's view of its group's stacked float cache: pages {"k", "v"} [layers,
  kv_heads, num_pages, page_size, head_dim], each row's page table [B, pages_per_seq] and
  this layer's index into the pages."""
  stores_latent = False
  pages: dict
  page_table: jnp.ndarray
  layer: jnp.ndarray

  def at(self, layer) -> "PagedCache":
    return self.replace(layer=layer)

  def update_and_attend(self, q, k, v, context, spec, sinks=None):
    """Store k, v [B, T, kv_heads, head_dim] at context.positions, then attend q to
    everything cached up to each query's position -> (out [B, T, heads, head_dim], cache)."""
    heads = self.pages["k"].shape[1]
    cache = write(self, fit_heads(k, heads), fit_heads(v, heads), context.positions)
    return cache.attend(q, context, spec, sinks), cache

  def attend(self, q, context, spec, sinks=None):
    """Attend q to everything cached up to each query's position, writing nothing."""
    # The stacked pages and the layer's index: a kernel that reads them in place (CPU decode)
    # need not copy the layer's pages out first.
    return pallas_kernels.paged_attention(q, self.pages["k"], self.pages["v"], context.positions,
                                          self.page_table, context.attention_spec(spec), layer=self.layer, sinks=sinks)


def write(cache: PagedCache, k, v, positions) -> PagedCache:
  """Store new keys/values [B, T, kv_heads, head_dim] at `positions` [B, T] in this layer's
  pages (an in-place scatter into the stacked cache)."""
  put = lambda pages, new: scatter(pages, cache.layer, cache.page_table, new, positions)  # noqa: E731
  return cache.replace(pages={"k": put(cache.pages["k"], k), "v": put(cache.pages["v"], v)})


def scatter(pages, layer, page_table, new, positions):
  """pages [L, Hkv, P, S, D] with `new` [B, T, Hkv, D] written at `positions` [B, T] of
  layer `layer`, through each row's page table.

  Negative positions (padding) and positions past the page table are dropped, so ragged
  batches need no masking by the caller.
  """
  _, _, num_pages, page_size, _ = pages.shape
  capacity = page_table.shape[1] * page_size
  valid = (positions >= 0) & (positions < capacity)
  safe = jnp.where(valid, positions, 0)
  page = jnp.take_along_axis(page_table, safe // page_size, axis=1)
  page = jnp.where(valid, page, num_pages)  # out of range: the scatter drops it
  slot = safe % page_size
  # The indexed dims are split by a slice, so (NumPy rules) the update is [B, T, Hkv, D].
  return pages.at[layer, :, page, slot].set(new.astype(pages.dtype), mode="drop")


def bytes_per_token(cfg, dtype) -> int:
  """Cache bytes one token takes across all layers (keys and values)."""
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jax.numpy.dtype(dtype).itemsize
