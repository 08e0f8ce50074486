"""Where attention's keys and values come from: cache kinds behind one interface.

An attention block computes q, k, v and makes one call, whatever the kind:

  out, cache = cache.update_and_attend(q, k, v, context, spec, sinks=None)

q [B, T, heads, head_dim], k and v [B, T, kv_heads, head_dim]; `context` the layer's
LayerContext (positions, segment ids, the length layout); `spec` its static
pallas_kernels.AttentionSpec (mask, soft cap, scale, kernel), which every kind hands to the
attention doors unchanged; `sinks` the layer's attention sinks [heads] (GPT-OSS), or None. A cache is stacked over
the layers of a group and rides through the layer scan; `cache.at(layer)` is one layer's
view. The kinds:

  NoCache                  training and full forwards: attend within the given sequence
                           (packed segments, zig-zag context parallelism)
  SimulatedKVQuantization  a full forward read as a quantized cache would hold it: how
                           KV quantization quality is measured (kv_quant.cached_attention)
  PagedCache               generation, float pages (kv_cache.py)
  QuantizedPagedCache      generation, int8 / KIVI pages with a float tail (kv_cache_quantized.py)
  LatentPagedCache         generation with multi-head latent attention: the latent, not
                           per-head keys and values (kv_cache_latent.py)
  LocalGlobalCache         generation when local (sliding) and global layers mix: the local
                           layers keep only their window, in per-slot rings (kv_cache_windowed.py)
  RecurrentState           generation with linear attention (Gated DeltaNet): no keys or
                           values, a fixed-size state per slot (recurrent_state.py); the block
                           reads and writes it itself rather than calling update_and_attend

A layer that reuses an earlier layer's keys and values (Gemma 4's KV sharing) calls
`out = cache.attend(q, context, spec, sinks=None)` on that layer's cache instead: attend to
what it holds, writing nothing. Float paged kinds (and rings) have it; a full forward keeps
the source layers' keys in KeptKeys.

A new kind is a class with `at`, `update_and_attend` and `stores_latent` (whether it holds
latents that an attention block attends to in absorbed form); the model picks the kind
here, once, from what the caller asks for, and an attention block's `init_cache` makes its
pages.
"""

import jax
import jax.numpy as jnp
from flax import struct

from jaxpar import pallas_kernels
from jaxpar.errors import ConfigError
from jaxpar.models import kv_cache, kv_cache_latent, kv_cache_quantized, kv_cache_windowed, kv_quant
from jaxpar.models.recurrent_state import RecurrentState
from jaxpar.models.registry import get_block


@struct.dataclass
class NoCache:
  """Nothing stored: the queries attend to the keys of the same call."""
  stores_latent = False

  def at(self, layer) -> "NoCache":
    return self

  def update_and_attend(self, q, k, v, context, spec, sinks=None):
    out = pallas_kernels.attention(q, k, v, spec, segment_ids=context.segment_ids, zigzag=context.zigzag,
                                   sinks=sinks)
    return out, self


@struct.dataclass
class KeptKeys:
  """A full forward's cache for layers whose keys and values later layers reuse: as NoCache,
  keeping the last keys and values k, v [B, L, kv_heads, head_dim] it attended with, which
  `attend` reads. Made with zeros of their shapes, so the scan's carry keeps its type."""
  stores_latent = False
  k: jnp.ndarray
  v: jnp.ndarray

  def at(self, layer) -> "KeptKeys":
    return self

  def update_and_attend(self, q, k, v, context, spec, sinks=None):
    return NoCache().update_and_attend(q, k, v, context, spec, sinks)[0], self.replace(k=k, v=v)

  def attend(self, q, context, spec, sinks=None):
    return NoCache().update_and_attend(q, self.k, self.v, context, spec, sinks)[0]


@struct.dataclass
class SimulatedKVQuantization:
  """Every query of a full forward reads the keys and values a quantized cache would give
  it when that token is decoded (`spec`: a kv_quant.KVQuantization)."""
  stores_latent = False
  spec: kv_quant.KVQuantization = struct.field(pytree_node=False)

  def at(self, layer) -> "SimulatedKVQuantization":
    return self

  def update_and_attend(self, q, k, v, context, spec, sinks=None):
    out = kv_quant.cached_attention(q, k, v, self.spec, spec, context.segment_ids, sinks=sinks)
    return out, self


def for_forward(kv_quantization=None):
  """The cache kind of a forward pass over whole sequences."""
  return NoCache() if kv_quantization is None else SimulatedKVQuantization(kv_quantization)


def for_generation(pages: dict, page_table, layer, *, kv_quantization=None, tail_index=None, windows=None):
  """A group's paged cache (`pages` as `init` made it) at `layer`, for rows whose pages
  `page_table` [B, pages_per_seq] lists; quantized when `kv_quantization` is given
  (`tail_index` [B]: each row's slot). `windows`: the group's per-layer sliding windows, for
  a cache `init` split into global pages and local rings. A linear-attention group's states
  are read per row's slot (`tail_index`; None: row i is slot i)."""
  if "delta" in pages:
    return RecurrentState(pages, jnp.arange(page_table.shape[0]) if tail_index is None else tail_index, layer)
  if "windowed" in pages:
    slots = jnp.arange(page_table.shape[0]) if tail_index is None else tail_index
    ring = kv_cache_windowed.ring_pages(max(w for w in windows if w), kv_cache_windowed.page_size(pages["windowed"]))
    part = lambda p, table: for_generation(p, table, layer, kv_quantization=kv_quantization,  # noqa: E731
                                           tail_index=slots)
    rings = part(pages["windowed"], kv_cache_windowed.ring_table(slots, page_table.shape[1], ring))
    if "full" not in pages:  # a group of local layers only
      return kv_cache_windowed.RingsOnly(rings)
    return kv_cache_windowed.LocalGlobalCache(part(pages["full"], page_table), rings, windows)
  if "latent" in pages:
    return kv_cache_latent.LatentPagedCache(pages, page_table, layer)
  if kv_quantization is None:
    return kv_cache.PagedCache(pages, page_table, layer)
  return kv_cache_quantized.QuantizedPagedCache(pages, page_table, tail_index, layer, kv_quantization)


def init(cfg, num_layers: int, num_pages: int, page_size: int, dtype, *, kv_quantization=None,
         slots: int = 1, windows=None, mixer: str | None = None, kv_repeat: int = 1, rings: bool = False) -> dict:
  """Zeroed pages for a group of `num_layers` layers, of the kind its attention block keeps
  (`init_cache`: float, or quantized with a float tail page per slot; multi-head latent
  attention's latent cache); `mixer`: the group's attention block (None: the model's). `windows`: the
  group's per-layer sliding windows; when local and global layers mix, the local layers get
  rings of their window's pages per slot instead of pool pages (kv_cache_windowed.py); so do
  a group of local layers only with `rings` (the model's global layers are another group:
  Gemma 4's).
  `kv_repeat`: copies of each KV head the pages hold (kv_cache.head_repeat), laid out as for
  a model with that many times the KV heads."""
  if getattr(get_block("attention", mixer or cfg.attention_block), "kv_source_mixer", None):
    return {}  # its layers read another group's pages (Gemma 4's KV sharing)
  if kv_repeat > 1:
    cfg = cfg.model_copy(update={"num_kv_heads": cfg.num_kv_heads * kv_repeat})
  if kv_cache_windowed.is_mixed(windows) or rings and windows and all(windows):
    full = sum(w is None for w in windows)
    ring = kv_cache_windowed.ring_pages(max(w for w in windows if w), page_size)
    part = lambda layers, pages: init(cfg, layers, pages, page_size, dtype,  # noqa: E731
                                      kv_quantization=kv_quantization, slots=slots, mixer=mixer)
    local = {"windowed": part(num_layers - full, slots * ring)}
    return {"full": part(full, num_pages), **local} if full else local
  return get_block("attention", mixer or cfg.attention_block).init_cache(
      cfg, num_layers, num_pages, page_size, dtype, kv_quantization=kv_quantization, slots=slots)


def cache_bytes(cache: dict) -> dict:
  """Device bytes of a model's cache (`init` per group): {"pool": pool pages, every layer's
  or the global layers', "rings": the local layers' window rings, "states": linear-attention
  layers' per-slot states}."""
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731 (or shapes)
  rings = sum(nbytes(pages.get("windowed", {})) for pages in cache.values())
  states = sum(nbytes(pages) for pages in cache.values() if "delta" in pages)
  return {"pool": nbytes(cache) - rings - states, "rings": rings, "states": states}


def copy_positions(cache: dict, page_table, source, target) -> dict:
  """A float (or latent) paged cache with each row's keys and values at positions `source`
  [B, m] copied to positions `target` [B, m] (negative: nothing), every layer at once: the
  candidates a speculative tree pass kept, moved to the slots right after its root. Every
  source is read before any target is written."""
  def move(pages):  # [layers, heads, num_pages, page_size, dim]
    num_pages, page_size = pages.shape[2], pages.shape[3]
    at = lambda positions: jnp.take_along_axis(page_table, jnp.maximum(positions, 0) // page_size, axis=1)  # noqa: E731
    values = pages[:, :, at(source), jnp.maximum(source, 0) % page_size]  # [layers, heads, B, m, dim]
    pages_to = jnp.where((source >= 0) & (target >= 0), at(target), num_pages)  # out of range: dropped
    return pages.at[:, :, pages_to, jnp.maximum(target, 0) % page_size].set(values, mode="drop")
  for name, pages in cache.items():
    if set(pages) - {"k", "v", "latent"}:
      raise ConfigError(f"layer group {name}: only float or latent paged caches move positions (a speculative "
                        "tree pass): serve with a float KV cache and without sliding-window or linear layers")
  return {name: {key: move(x) for key, x in pages.items()} for name, pages in cache.items()}
