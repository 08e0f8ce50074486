"""A paged KV cache stored quantized (int8, KIVI int4/int2): what `--kv-cache` switches on.

Complete pages live quantized in the page pool (`models/kv_quant.py` defines the format:
keys per token for int8, per channel over the page for KIVI; values per token). A
sequence's newest, incomplete page stays in float in a per-slot `tail` page until it fills
(KIVI's full-precision residual, one page long), then is quantized into its pool page. So
a query reads every complete page quantized and its own partial page in float: exactly
`kv_quant.cached_attention` with window 0, which is how quality is measured. Decoding an
int8 cache on TPU, the kernel reads the pool as stored (`pallas_kernels.int8_paged_decode`:
codes and scales into VMEM, the row's tail for its partial page); elsewhere, and for the
KIVI modes, the pages a step can see are dequantized by XLA first (`read`).

Cache per layer group: {"k": {"q", "scale"[, "zero"]}, "v": {...}} over
[layers, kv_heads, num_pages, page_size, ...], and "tail_k" / "tail_v" [layers, kv_heads,
slots, page_size, head_dim] in the compute dtype. `QuantizedPagedCache` is this layout
as a cache kind (models/caches.py).
"""

import jax
import jax.numpy as jnp
from flax import struct

from jaxpar import pallas_kernels
from jaxpar.models import kv_cache, kv_quant


def init(cfg, num_layers: int, num_pages: int, page_size: int, slots: int, spec, dtype) -> dict:
  """A zeroed quantized cache for one group of layers."""
  shape = (num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
  zeros = jnp.zeros(shape, jnp.float32)
  pool = jax.eval_shape(lambda: kv_quant.quantize_pages(zeros, zeros, spec))
  tail = (num_layers, cfg.num_kv_heads, slots, page_size, cfg.head_dim)
  return {**jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), pool),
          "tail_k": jnp.zeros(tail, dtype), "tail_v": jnp.zeros(tail, dtype)}


def _layer(tree, layer):
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, layer, keepdims=False), tree)


@struct.dataclass
class QuantizedPagedCache:
  """One layer's view of its group's stacked quantized cache (the layout above), each row's
  page table [B, pages_per_seq] and slot (`tail_index` [B]: its tail page), this layer's
  index, and the quantization spec (a kv_quant.KVQuantization)."""
  stores_latent = False
  pages: dict
  page_table: jnp.ndarray
  tail_index: jnp.ndarray
  layer: jnp.ndarray
  spec: kv_quant.KVQuantization = struct.field(pytree_node=False)

  def at(self, layer) -> "QuantizedPagedCache":
    return self.replace(layer=layer)

  def update_and_attend(self, q, k, v, context, spec, sinks=None):
    """Store k, v [B, T, kv_heads, head_dim] at context.positions (contiguous per row), then
    attend q to what a decode step reads back: only the pages the queries' window can see
    are dequantized -> (out [B, T, heads, head_dim], cache)."""
    positions = context.positions
    heads = self.pages["tail_k"].shape[1]
    cache = write(self, kv_cache.fit_heads(k, heads), kv_cache.fit_heads(v, heads), positions)
    if q.shape[1] == 1 and self.spec.mode == "int8" and pallas_kernels.reads_int8_pages(spec):
      # Decoding on TPU: the kernel reads the int8 pages as stored and dequantizes in VMEM.
      pool = cache.pages
      int8 = pallas_kernels.Int8Pages(pool["k"]["scale"], pool["v"]["scale"], pool["tail_k"], pool["tail_v"],
                                      cache.tail_index)
      out = pallas_kernels.int8_paged_decode(q[:, 0], pool["k"]["q"], pool["v"]["q"], int8,
                                             jnp.maximum(positions[:, 0] + 1, 0), cache.page_table, spec,
                                             layer=cache.layer, sinks=sinks)
      return out[:, None], cache
    page_size = self.pages["tail_k"].shape[3]
    table, start = pallas_kernels.visible_pages(self.page_table, positions, page_size, spec.sliding_window)
    positions = jnp.where(positions >= 0, positions - start[:, None], -1)  # relative to the visible pages
    k_pages, v_pages, table = read(cache, table, jnp.max(positions, axis=1), q.dtype)
    out = pallas_kernels.paged_attention(q, k_pages, v_pages, positions, table, spec, sinks=sinks)
    return out, cache


def write(cache: QuantizedPagedCache, k, v, positions) -> QuantizedPagedCache:
  """Write new tokens [B, T, kv_heads, head_dim] at `positions` [B, T] (contiguous per row;
  negative: padding) -> the cache with every page they complete quantized into the pool and
  each row's partial page in its tail."""
  pages, layer, page_table, tail_index = cache.pages, cache.layer, cache.page_table, cache.tail_index
  page_size = pages["tail_k"].shape[3]
  num_pages = pages["k"]["q"].shape[2]
  batch, length = positions.shape
  span = length // page_size + 2  # pages a row's new tokens can touch
  valid = positions >= 0
  first = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1)
  last = jnp.max(jnp.where(valid, positions, -1), axis=1)
  has = last >= 0
  first = jnp.where(has, first, 0)
  base = first // page_size  # the row's first touched page

  def dense(tail, new):  # [L, H, slots, S, D] tails, [B, T, H, D] new -> [B, span, S, H, D]
    old = jnp.moveaxis(_layer(tail, layer)[:, tail_index], 0, 2)  # [B, S, H, D]: older tokens of page base
    buffer = jnp.zeros((batch, span * page_size) + new.shape[2:], tail.dtype)
    buffer = buffer.at[:, :page_size].set(old)
    offset = jnp.where(valid, positions - (base * page_size)[:, None], span * page_size)
    buffer = buffer.at[jnp.arange(batch)[:, None], offset].set(new.astype(tail.dtype), mode="drop")
    return buffer.reshape(batch, span, page_size, *new.shape[2:])

  k_dense, v_dense = dense(pages["tail_k"], k), dense(pages["tail_v"], v)
  to_pool = lambda x: jnp.moveaxis(x, 3, 2)  # [B, span, S, H, D] -> [B, span, H, S, D]  # noqa: E731
  stored = kv_quant.quantize_pages(to_pool(k_dense), to_pool(v_dense), cache.spec)
  index = base[:, None] + jnp.arange(span)
  complete = has[:, None] & ((index + 1) * page_size - 1 <= last[:, None])
  in_table = index < page_table.shape[1]
  target = jnp.where(complete & in_table, jnp.take_along_axis(page_table, jnp.minimum(index, page_table.shape[1] - 1),
                                                              axis=1), num_pages)

  def put(pool, new):  # pool [L, H, P, S, ...]; new [B, span, H, S, ...]
    # The indexed dims are split by a slice, so (NumPy rules) the update is [B, span, H, ...].
    return pool.at[layer, :, target].set(new.astype(pool.dtype), mode="drop")
  pool = {name: jax.tree.map(put, pages[name], stored[name]) for name in ("k", "v")}
  # The row's partial page, if its newest token does not complete one, becomes its tail.
  partial = has & ((last + 1) % page_size != 0)
  which = jnp.clip(last // page_size - base, 0, span - 1)
  slot = jnp.where(partial, tail_index, pages["tail_k"].shape[2])

  def keep_tail(tail, dense):  # dense [B, span, S, H, D] -> tail [L, H, slots, S, D]
    rows = dense[jnp.arange(batch), which]  # [B, S, H, D]
    return tail.at[layer, :, slot].set(jnp.moveaxis(rows, 2, 1), mode="drop")  # update [B, H, S, D]
  pool["tail_k"], pool["tail_v"] = keep_tail(pages["tail_k"], k_dense), keep_tail(pages["tail_v"], v_dense)
  return cache.replace(pages=pool)


def read(cache: QuantizedPagedCache, page_table, newest, dtype):
  """The float keys and values a step's queries read from the pages of `page_table` [B, n]
  (page-aligned: `newest` [B] counts from its first page) -> (k, v) [kv_heads, B * n,
  page_size, head_dim] with the row-major page table [B, n] that indexes them: complete
  pages dequantized, each row's partial page (the one holding `newest`) from its tail."""
  pages, layer, tail_index, spec = cache.pages, cache.layer, cache.tail_index, cache.spec
  page_size = pages["tail_k"].shape[3]
  batch, n = page_table.shape
  gathered = {name: jax.tree.map(lambda x: _layer(x, layer)[:, page_table], pages[name]) for name in ("k", "v")}
  k, v = kv_quant.dequantize_pages(gathered, spec, dtype)  # [H, B, n, S, D]
  partial = (newest + 1) % page_size != 0
  here = (jnp.arange(n)[None, :] == (newest // page_size)[:, None]) & partial[:, None]  # [B, n]

  def with_tail(full, tail):
    own = _layer(tail, layer)[:, tail_index]  # [H, B, S, D]
    return jnp.where(here[None, :, :, None, None], own[:, :, None], full)
  k, v = with_tail(k, pages["tail_k"]), with_tail(v, pages["tail_v"])
  table = jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)
  return k.reshape(k.shape[0], batch * n, page_size, -1), v.reshape(v.shape[0], batch * n, page_size, -1), table


def bytes_per_page(cfg, page_size: int, spec) -> int:
  """Pool bytes one page of every layer takes (keys and values, scales included)."""
  zeros = jnp.zeros((1, cfg.num_kv_heads, 1, page_size, cfg.head_dim), jnp.float32)
  shapes = jax.eval_shape(lambda: kv_quant.quantize_pages(zeros, zeros, spec))
  return cfg.num_layers * sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(shapes))
