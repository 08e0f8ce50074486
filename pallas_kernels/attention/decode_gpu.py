"""Paged decode attention for GPU (Pallas Triton): one new token per sequence, ragged lengths.

Grid (batch, kv_head). Each program walks only the live pages of its sequence
through the page table; all query heads of the kv head share each loaded page
(GQA). Decode is memory-bound, so the [group, page] products use vector units,
which also lifts Triton's 16-row minimum for matmuls.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.errors import UserError
from jaxpar.pallas_kernels.attention import decode_common, masking, validation


@dataclasses.dataclass(frozen=True)
class _Static:
  sliding_window: int | None
  logit_soft_cap: float | None
  scale: float
  page_size: int


def _kernel(lengths_ref, table_ref, q_ref, k_ref, v_ref, o_ref, *, st):
  length = lengths_ref[0]
  q = q_ref[...].astype(jnp.float32)  # [group, D]

  def step(j, carry):
    m, l, acc = carry
    page = table_ref[j]
    k = k_ref[page].astype(jnp.float32)  # [page_size, D]
    s = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1) * st.scale
    k_pos = j * st.page_size + jnp.arange(st.page_size)[None, :]
    mask = masking.token_mask(length - 1, k_pos, causal=True, sliding_window=st.sliding_window,
                              kv_len=length)
    s = jnp.where(mask, masking.soft_cap(s, st.logit_soft_cap), masking.MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_next[:, None])
    alpha = jnp.exp(m - m_next)
    v = v_ref[page].astype(jnp.float32)
    pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_next, alpha * l + p.sum(axis=1), alpha[:, None] * acc + pv

  group = q.shape[0]
  first, last = decode_common.live_pages(length, st.page_size, st.sliding_window)
  init = (jnp.full((group,), masking.MASK_VALUE, jnp.float32), jnp.zeros((group,), jnp.float32),
          jnp.zeros(q.shape, jnp.float32))
  _, l, acc = lax.fori_loop(first, last + 1, step, init)
  o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def paged_decode_attention_gpu(q, k_pages, v_pages, lengths, page_table, *, sliding_window=None,
                               logit_soft_cap=None, scale=None, interpret=False):
  """q: [B, Hq, D]; k/v_pages: [Hkv, num_pages, page_size, D]; lengths: [B]; page_table: [B, n]."""
  decode_common.check_decode_args(q, k_pages, v_pages, lengths, page_table,
                                  validation.SUPPORTED_HEAD_DIMS)
  batch, num_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  for name, n in (("q heads per kv head", group), ("page_size", page_size)):
    if n & (n - 1):
      raise UserError(f"{name}={n} must be a power of two for the Triton decode kernel")
  st = _Static(sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
               scale=head_dim ** -0.5 if scale is None else scale, page_size=page_size)
  q_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h: (b, h, 0, 0))
  pages_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h: (h, 0, 0, 0))
  qg = q.reshape(batch, num_kv_heads, group, head_dim)
  out = pl.pallas_call(
      functools.partial(_kernel, st=st),
      grid=(batch, num_kv_heads),
      in_specs=[pl.BlockSpec((1,), lambda b, h: (b,)),
                pl.BlockSpec((None, page_table.shape[1]), lambda b, h: (b, 0)),
                q_spec, pages_spec, pages_spec],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype, manual_axis_type=jax.typeof(q).mat),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="paged_decode_attention",
  )(lengths.astype(jnp.int32), page_table.astype(jnp.int32), qg, k_pages, v_pages)
  return out.reshape(batch, num_heads, head_dim)
