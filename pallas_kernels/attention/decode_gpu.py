"""Paged decode attention for GPU (Pallas Triton): one new token per sequence, ragged lengths.

Grid (batch, kv_head, split). Each program walks its split's share of the live pages of its
sequence through the page table (flash-decoding: a few sequences still fill the GPU; the
partial softmaxes are combined after), in its layer of a pool stacked over layers (slicing the layer out
first would copy it); all query heads of the kv head share each loaded page
(GQA). Decode is memory-bound, so the [group, page] products use vector units,
which also lifts Triton's 16-row minimum for matmuls. Triton tiles are powers of two, so
a head dim that is not one (576: multi-head latent attention's latent plus its rotary
part) is read as power-of-two pieces (512 + 64) whose scores add up; values may be the
keys' first `value_dim` entries (the latent), read once. Attention sinks (one logit per
query head) join the combination as one more key of value zero.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.errors import UserError
from jaxpar.pallas_kernels.attention import decode_common, masking
from jaxpar.pallas_kernels.attention.spec import AttentionSpec
from jaxpar.pallas_kernels.platform import multiprocessors


@dataclasses.dataclass(frozen=True)
class _Static:
  spec: AttentionSpec
  scale: float
  page_size: int
  pieces: tuple[tuple[int, int], ...]  # (start, size) of the power-of-two pieces of head_dim
  value_dim: int
  pages_per_split: int  # table columns each program of a sequence walks


def power_of_two_pieces(dim: int) -> tuple[tuple[int, int], ...]:
  """(start, size) of `dim` cut into powers of two, largest first: 576 -> (0, 512), (512, 64)."""
  pieces, start = [], 0
  for bit in reversed(range(dim.bit_length())):
    if dim & (1 << bit):
      pieces.append((start, 1 << bit))
      start += 1 << bit
  return tuple(pieces)


def _kernel(layer_ref, lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, st):
  layer, length, split = layer_ref[0], lengths_ref[0], pl.program_id(2)
  qs = [q_ref[:, pl.ds(start, size)].astype(jnp.float32) for start, size in st.pieces]  # [group, piece]

  def step(j, carry):
    m, l, acc = carry
    page = table_ref[j]
    s = sum(jnp.sum(q[:, None, :] * k_ref[layer, page, :, pl.ds(start, size)].astype(jnp.float32)[None], axis=-1)
            for q, (start, size) in zip(qs, st.pieces)) * st.scale
    k_pos = j * st.page_size + jnp.arange(st.page_size)[None, :]
    mask = masking.token_mask(length - 1, k_pos, st.spec.mask, kv_len=length)
    s = jnp.where(mask, masking.soft_cap(s, st.spec.logit_soft_cap), masking.MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_next[:, None])
    alpha = jnp.exp(m - m_next)
    values = k_ref if v_ref is None else v_ref  # no v pages: the latent keys hold the values
    v = values[layer, page, :, pl.ds(0, st.value_dim)].astype(jnp.float32)
    pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_next, alpha * l + p.sum(axis=1), alpha[:, None] * acc + pv

  group = qs[0].shape[0]
  first, last = decode_common.live_pages(length, st.page_size, st.spec.sliding_window)
  # This program's share of the live pages: split s of the table's columns.
  first = jnp.maximum(first, split * st.pages_per_split)
  last = jnp.minimum(last, split * st.pages_per_split + st.pages_per_split - 1)
  init = (jnp.full((group,), masking.MASK_VALUE, jnp.float32), jnp.zeros((group,), jnp.float32),
          jnp.zeros((group, st.value_dim), jnp.float32))
  m, l, acc = lax.fori_loop(first, last + 1, step, init)
  o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def combine_splits(acc, m, l, sinks):
  """Partial softmaxes over page ranges [..., S, G, (Dv)] -> the attention [..., G, Dv]; each
  query head's sink (or None) joins as one more key of value zero."""
  top = m.max(axis=-2)
  if sinks is not None:
    top = jnp.maximum(top, sinks)
  weight = jnp.exp(m - top[..., None, :])
  total = jnp.sum(weight * l, axis=-2)
  if sinks is not None:
    total = total + jnp.exp(sinks - top)
  out = jnp.sum(weight[..., None] * acc, axis=-3)
  return out / jnp.where(total == 0.0, 1.0, total)[..., None]


def default_splits(programs: int, pages_per_seq: int) -> int:
  """How many programs share one sequence's pages: enough for about 8 programs per
  multiprocessor (one page walk is latency-bound; many in flight hide it), each walking at
  least 4 pages, a power of two."""
  wanted = -(-8 * multiprocessors() // programs)
  return max(1, min(pl.next_power_of_2(wanted), pl.next_power_of_2(-(-pages_per_seq // 4))))


def paged_decode_attention_gpu(q, k_pages, v_pages, lengths, page_table, spec: AttentionSpec = AttentionSpec(), *,
                               layer=None, sinks=None, splits=None):
  """q: [B, Hq, D]; k_pages: [Hkv, num_pages, page_size, D]; v_pages: [.., Dv], or None with
  spec.value_dim (the keys' first value_dim entries); with `layer` (an int scalar) both
  stacked over layers [layers, Hkv, ...] and that layer's read; lengths: [B]; page_table:
  [B, n]; sinks: [Hq] or None -> [B, Hq, Dv]. splits: programs per (sequence, kv head),
  each over its own range of pages, their partial softmaxes combined after (flash-decoding;
  None: `default_splits`)."""
  k_pages, v_pages, layer, value_dim = decode_common.stacked_inputs(q, k_pages, v_pages, lengths, page_table, layer,
                                                                    spec.value_dim, sinks)
  batch, num_heads, head_dim = q.shape
  num_layers, num_kv_heads, num_pages, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  for name, n in (("q heads per kv head", group), ("page_size", page_size), ("value head_dim", value_dim)):
    if n & (n - 1):
      raise UserError(f"{name}={n} must be a power of two for the Triton decode kernel")
  pages_per_seq = page_table.shape[1]
  splits = splits or default_splits(batch * num_kv_heads, pages_per_seq)
  st = _Static(spec=spec, scale=spec.scale_for(head_dim), page_size=page_size,
               pieces=power_of_two_pieces(head_dim), value_dim=value_dim,
               pages_per_split=-(-pages_per_seq // splits))
  q_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, s: (b, h, 0, 0))
  # Every layer's pages of kv head h: the kernel indexes the layer (block shapes are static).
  k_spec, v_spec = (pl.BlockSpec((num_layers, None, num_pages, page_size, d), lambda b, h, s: (0, h, 0, 0, 0))
                    for d in (head_dim, value_dim))
  v_spec = None if v_pages is None else v_spec  # latent: values are read from the key pages
  partial = (batch, num_kv_heads, splits, group)
  mat = jax.typeof(q).mat
  acc, m, l = pl.pallas_call(
      functools.partial(_kernel, st=st),
      grid=(batch, num_kv_heads, splits),
      in_specs=[pl.BlockSpec((1,), lambda b, h, s: (0,)),  # the layer
                pl.BlockSpec((1,), lambda b, h, s: (b,)),
                pl.BlockSpec((None, pages_per_seq), lambda b, h, s: (b, 0)),
                q_spec, k_spec, v_spec],
      out_specs=[pl.BlockSpec((None, None, None, group, value_dim), lambda b, h, s: (b, h, s, 0, 0)),
                 *[pl.BlockSpec((None, None, None, group), lambda b, h, s: (b, h, s, 0))] * 2],
      out_shape=[jax.ShapeDtypeStruct((*partial, value_dim), jnp.float32, manual_axis_type=mat),
                 *[jax.ShapeDtypeStruct(partial, jnp.float32, manual_axis_type=mat)] * 2],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=spec.interpret,
      name="paged_decode_attention",
  )(layer, lengths.astype(jnp.int32), page_table.astype(jnp.int32), q.reshape(batch, num_kv_heads, group, head_dim),
    k_pages, v_pages)
  heads_sinks = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group)
  return combine_splits(acc, m, l, heads_sinks).reshape(batch, num_heads, value_dim).astype(q.dtype)
