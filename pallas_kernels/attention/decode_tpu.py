"""Paged decode attention for TPU (Mosaic): one new token per sequence, ragged lengths.

Grid (batch, kv_head, page). The layer's index, the page table and lengths are
scalar-prefetched into SMEM so the K/V index maps fetch the right page of the right layer
straight from a pool stacked over layers (slicing the layer out first would copy it);
steps past a sequence's end
re-use the last live page (no DMA) and skip compute. All query heads of a kv head
form one [group, head_dim] tile, so GQA reads each page once. Values may have their own
head dim, or be the first `value_dim` entries of each key (multi-head latent attention's
absorbed form: one latent page array holds both, read once). Attention sinks (one logit
per query head, in SMEM) start each row's online softmax at (max = sink, sum = 1).

An int8 cache (`Int8Pages`: jaxpar's int8 KV pages, models/kv_quant.py) is read as stored:
each page's int8 codes and per-token scales come into VMEM, the codes become the compute
type there (exactly: |code| <= 127), and the scales, one per token, multiply the scores
(keys) and the probabilities (values) instead of the pages: the scales are a row
[1, page_size] (kv_quant stores them so; a column block is another tiled layout, which XLA
would copy the whole pool to provide). A row's partial page (its newest, not yet quantized)
comes from its float tail.
"""

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpar.errors import UserError
from jaxpar.pallas_kernels.attention import decode_common, masking
from jaxpar.pallas_kernels.attention.spec import AttentionSpec
from jaxpar.pallas_kernels.tpu_matmul import mxu_dot

_LANES = 128


@dataclasses.dataclass(frozen=True)
class _Static:
  spec: AttentionSpec
  scale: float
  page_size: int
  pages_per_seq: int
  value_dim: int


class Int8Pages(NamedTuple):
  """An int8 paged cache as jaxpar stores it (models/kv_quant.py), stacked over layers: codes
  [layers, Hkv, num_pages, page_size, D] int8 holding q + 128 (q in [-127, 127]), scales
  [.., 1, page_size] (one per token, stored as a row), and each row's partial page in float:
  tails [layers, Hkv, slots, page_size, D] at slot tail_index[b]."""
  k_scales: jax.Array
  v_scales: jax.Array
  k_tails: jax.Array
  v_tails: jax.Array
  tail_index: jax.Array


def _page(codes, scales, tail, use_tail, dtype):
  """(one page's unscaled values in `dtype`: its codes as stored, q = code + 128 mod 256 - 128,
  or the float tail; the per-token scales [1, page_size] in f32, ones for the tail)."""
  signed = codes.astype(jnp.int32)
  q = jnp.where(signed < 0, signed + 128, signed - 128).astype(dtype)
  return jnp.where(use_tail, tail.astype(dtype), q), jnp.where(use_tail, 1.0, scales.astype(jnp.float32))


def _kernel(layer_ref, lengths_ref, table_ref, *refs, st):
  if len(refs) == 13:  # int8 pages: the tails' slots (used by the index maps), scales and tails
    _, q_ref, k_ref, v_ref, ks_ref, vs_ref, kt_ref, vt_ref, sinks_ref, o_ref, m_scr, l_scr, acc_scr = refs
  else:
    ks_ref = None
    q_ref, k_ref, v_ref, sinks_ref, o_ref, m_scr, l_scr, acc_scr = refs
  b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  length = lengths_ref[b]

  @pl.when(j == 0)
  def _init():
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
    if sinks_ref is None:
      m_scr[...] = jnp.full(m_scr.shape, masking.MASK_VALUE, jnp.float32)
      l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
      return
    # The sink: a first key of value zero. Row g of the tile is query head h * group + g.
    group = m_scr.shape[0]
    row = lax.broadcasted_iota(jnp.int32, m_scr.shape, 0)
    sink = jnp.zeros(m_scr.shape, jnp.float32)
    for g in range(group):
      sink = jnp.where(row == g, sinks_ref[h * group + g], sink)
    m_scr[...] = sink
    l_scr[...] = jnp.ones(l_scr.shape, jnp.float32)

  first, last = decode_common.live_pages(length, st.page_size, st.spec.sliding_window)

  @pl.when((j >= first) & (j <= last))
  def _step():
    k_scale = v_scale = None
    if ks_ref is None:
      k = k_ref[...]
      v = k[:, :st.value_dim] if v_ref is None else v_ref[...]  # no v pages: the latent keys hold them
    else:
      use_tail = (j == last) & (length % st.page_size != 0)  # the newest page, still in float
      k, k_scale = _page(k_ref[...], ks_ref[...], kt_ref[...], use_tail, q_ref.dtype)
      v, v_scale = _page(v_ref[...], vs_ref[...], vt_ref[...], use_tail, q_ref.dtype)
    s = mxu_dot(q_ref[...], k, trans_b=True) * st.scale
    if k_scale is not None:  # q . (code x scale) = (q . code) x scale, one scale per key
      s = s * k_scale
    k_pos = j * st.page_size + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    mask = masking.token_mask(length - 1, k_pos, st.spec.mask, kv_len=length)
    s = jnp.where(mask, masking.soft_cap(s, st.spec.logit_soft_cap), masking.MASK_VALUE)
    m_prev = m_scr[...]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_next[:, :1])
    alpha = jnp.exp(m_prev - m_next)
    l_scr[...] = alpha * l_scr[...] + p.sum(axis=1, keepdims=True)
    # p @ (code x scale) = (p x scale) @ code, one scale per value row (not in l: p's own sum)
    pv = mxu_dot((p if v_scale is None else p * v_scale).astype(v.dtype), v)
    acc_scr[...] = acc_scr[...] * alpha[:, :1] + pv
    m_scr[...] = m_next

  @pl.when(j == st.pages_per_seq - 1)
  def _finish():
    l = l_scr[...]
    o_ref[...] = (acc_scr[...] / jnp.where(l == 0.0, 1.0, l)[:, :1]).astype(o_ref.dtype)


def _cost(q, k_pages, pages_per_seq, value_dim, shared_values, int8=None):
  """At full context (every page of the table live; shorter sequences skip pages): two
  matmuls over all cached keys, one exp per score, each K/V page read once per sequence
  (int8 pages: a byte per element and a scale per token and head)."""
  batch, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape[-4:]
  keys = pages_per_seq * page_size
  scores = batch * num_heads * keys
  per_key = head_dim + (0 if shared_values else value_dim)
  cache_bytes = batch * num_kv_heads * keys * per_key * k_pages.dtype.itemsize
  if int8 is not None:
    cache_bytes += 2 * batch * num_kv_heads * keys * int8.k_scales.dtype.itemsize
  return pl.CostEstimate(flops=2 * scores * (head_dim + value_dim), transcendentals=scores,
                         bytes_accessed=cache_bytes + q.size * q.dtype.itemsize
                         + batch * num_heads * value_dim * q.dtype.itemsize)


def paged_decode_attention_tpu(q, k_pages, v_pages, lengths, page_table, spec: AttentionSpec = AttentionSpec(), *,
                               layer=None, sinks=None, int8: Int8Pages | None = None):
  """q: [B, Hq, D]; k_pages: [Hkv, num_pages, page_size, D]; v_pages: [.., Dv], or None with
  spec.value_dim (the keys' first value_dim entries); with `layer` (an int scalar) both
  stacked over layers [layers, Hkv, ...] and that layer's read; lengths: [B]; page_table:
  [B, n]; sinks: [Hq] or None -> [B, Hq, Dv]. int8: the pages are int8 codes, with their
  scales and each row's float tail (Int8Pages, stacked over layers like the codes)."""
  if int8 is not None and (layer is None or v_pages is None):
    raise UserError("int8 pages are read from the pool stacked over layers, keys and values apart: give layer "
                    "and v_pages")
  k_pages, v_pages, layer, value_dim = decode_common.stacked_inputs(q, k_pages, v_pages, lengths, page_table, layer,
                                                                    spec.value_dim, sinks)
  batch, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape[1:]
  if page_size % 8:
    raise UserError(f"page_size={page_size} must be a multiple of 8 for the TPU decode kernel")
  group = num_heads // num_kv_heads
  pages_per_seq = page_table.shape[1]
  st = _Static(spec=spec, scale=spec.scale_for(head_dim), page_size=page_size, pages_per_seq=pages_per_seq,
               value_dim=value_dim)

  def page_index(b, h, j, layer_ref, lengths_ref, table_ref, *_):
    page = decode_common.clamp_page(j, lengths_ref[b], page_size, spec.sliding_window)
    return (layer_ref[0], h, table_ref[b * pages_per_seq + page], 0, 0)

  q_spec, o_spec = (pl.BlockSpec((None, None, group, d), lambda b, h, j, *_: (b, h, 0, 0))
                    for d in (head_dim, value_dim))
  k_spec = pl.BlockSpec((None, None, None, page_size, head_dim), page_index)
  v_spec = None if v_pages is None else pl.BlockSpec((None, None, None, page_size, value_dim), page_index)
  prefetched = (layer, lengths.astype(jnp.int32), page_table.astype(jnp.int32).reshape(-1))
  extra_specs, extra = [], []
  if int8 is not None:  # per-token scales beside each page; the row's tail slot, fetched once per row
    # The layer's scales only, sliced out first: a few MiB, where handing the kernel the whole
    # stack made XLA relayout all of it (every layer's) for every layer of the step.
    int8 = int8._replace(**{name: lax.dynamic_index_in_dim(getattr(int8, name), layer[0], keepdims=True)
                            for name in ("k_scales", "v_scales")})
    scale_spec = pl.BlockSpec((None, None, None, 1, page_size),
                              lambda *args: (0, *page_index(*args)[1:]))
    tail_spec = pl.BlockSpec((None, None, None, page_size, head_dim),
                             lambda b, h, j, layer_ref, lengths_ref, table_ref, tail_ref: (layer_ref[0], h, tail_ref[b], 0, 0))
    extra_specs, extra = [scale_spec, scale_spec, tail_spec, tail_spec], list(int8[:4])
    prefetched += (int8.tail_index.astype(jnp.int32),)
  qg = q.reshape(batch, num_kv_heads, group, head_dim)
  out = pl.pallas_call(
      functools.partial(_kernel, st=st),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(prefetched),
          grid=(batch, num_kv_heads, pages_per_seq),
          in_specs=[q_spec, k_spec, v_spec, *extra_specs,
                    None if sinks is None else pl.BlockSpec(memory_space=pltpu.SMEM)],
          out_specs=o_spec,
          scratch_shapes=[pltpu.VMEM((group, _LANES), jnp.float32),
                          pltpu.VMEM((group, _LANES), jnp.float32),
                          pltpu.VMEM((group, value_dim), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, group, value_dim), q.dtype,
                                     manual_axis_type=jax.typeof(q).mat),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=_cost(q, k_pages, pages_per_seq, value_dim, v_pages is None, int8),
      interpret=spec.interpret,
      name="paged_decode_attention" if int8 is None else "paged_decode_attention_int8",
  )(*prefetched, qg, k_pages, v_pages, *extra, None if sinks is None else sinks.astype(jnp.float32))
  return out.reshape(batch, num_heads, value_dim)
