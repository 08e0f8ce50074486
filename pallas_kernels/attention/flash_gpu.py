"""FlashAttention-2 for GPU (Pallas Triton backend): forward with online softmax,
backward as a dK/dV kernel and a dQ kernel that recompute from the log-sum-exp.

Works on [batch, length, heads, head_dim] directly (Triton loads strided tiles).
A query tile is one head; the K/V index map sends query head h to kv head
h // group, and the dK/dV kernel loops over the group, so K/V are never repeated.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.attention import masking, validation
from jaxpar.pallas_kernels.attention.block_sizes import default_block_sizes
from jaxpar.pallas_kernels.attention.lse_vjp import with_lse_vjp


@dataclasses.dataclass(frozen=True)
class _Static:
  causal: bool
  sliding_window: int | None
  logit_soft_cap: float | None
  scale: float
  q_offset: int
  kv_len: int
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int
  interpret: bool


def _mask(st, i, j, bq, bk, q_seg, k_seg):
  q_pos = st.q_offset + i * bq + jnp.arange(bq)[:, None]
  k_pos = j * bk + jnp.arange(bk)[None, :]
  segs = {} if q_seg is None else dict(q_seg=q_seg[:, None], k_seg=k_seg[None, :])
  return masking.token_mask(q_pos, k_pos, causal=st.causal, sliding_window=st.sliding_window,
                            kv_len=st.kv_len, **segs)


def _kv_range(st, i, bq, bk):
  q_lo = st.q_offset + i * bq
  return masking.kv_block_range(q_lo, q_lo + bq - 1, bk, causal=st.causal,
                                sliding_window=st.sliding_window, kv_len=st.kv_len)


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, kv_seg_ref, o_ref, lse_ref, *, st):
  bq, bk = st.block_q, st.block_k
  i = pl.program_id(0)
  q = q_ref[...]
  q_seg = None if seg_ref is None else seg_ref[...]

  def step(j, carry):
    m, l, acc = carry
    ks = pl.ds(j * bk, bk)
    s = plgpu.dot(q, k_ref[ks, :], trans_b=True) * st.scale
    k_seg = None if kv_seg_ref is None else kv_seg_ref[ks]
    mask = _mask(st, i, j, bq, bk, q_seg, k_seg)
    s = jnp.where(mask, masking.soft_cap(s, st.logit_soft_cap), masking.MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_next[:, None])
    alpha = jnp.exp(m - m_next)
    v = v_ref[ks, :]
    acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
    return m_next, alpha * l + p.sum(axis=1), acc

  first, last = _kv_range(st, i, bq, bk)
  init = (jnp.full((bq,), masking.MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros(q.shape, jnp.float32))
  m, l, acc = lax.fori_loop(first, last + 1, step, init)
  l = jnp.where(l == 0.0, 1.0, l)  # rows that saw only padding stay finite
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _bwd_tile(st, q, k, v, do, lse, delta, mask):
  """[bq, bk] probabilities and d(logits) for one query head."""
  raw = plgpu.dot(q, k, trans_b=True) * st.scale
  capped = masking.soft_cap(raw, st.logit_soft_cap)
  p = jnp.exp(jnp.where(mask, capped, masking.MASK_VALUE) - lse[:, None])
  dp = plgpu.dot(do, v, trans_b=True)
  ds = p * (dp - delta[:, None]) * masking.soft_cap_grad(capped, st.logit_soft_cap)
  return p, ds


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, kv_seg_ref,
                dk_ref, dv_ref, *, st, group, num_q_blocks):
  bq, bk = st.block_q_bwd, st.block_k_bwd
  j = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]
  k_seg = None if kv_seg_ref is None else kv_seg_ref[...]
  first, last = masking.q_block_range(j * bk, j * bk + bk - 1, bq, num_q_blocks,
                                      q_offset=st.q_offset, causal=st.causal,
                                      sliding_window=st.sliding_window)

  def step(i, carry, g):
    dk, dv = carry
    qs = pl.ds(i * bq, bq)
    q, do = q_ref[qs, g, :], do_ref[qs, g, :]
    q_seg = None if seg_ref is None else seg_ref[qs]
    mask = _mask(st, i, j, bq, bk, q_seg, k_seg)
    p, ds = _bwd_tile(st, q, k, v, do, lse_ref[g, qs], delta_ref[g, qs], mask)
    dv += plgpu.dot(p.astype(do.dtype), do, trans_a=True)
    dk += plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  for g in range(group):
    carry = lax.fori_loop(first, last + 1, functools.partial(step, g=g), carry)
  dk, dv = carry
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, kv_seg_ref, dq_ref,
               *, st):
  bq, bk = st.block_q_bwd, st.block_k_bwd
  i = pl.program_id(0)
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  q_seg = None if seg_ref is None else seg_ref[...]

  def step(j, dq):
    ks = pl.ds(j * bk, bk)
    k = k_ref[ks, :]
    k_seg = None if kv_seg_ref is None else kv_seg_ref[ks]
    _, ds = _bwd_tile(st, q, k, v_ref[ks, :], do, lse, delta, _mask(st, i, j, bq, bk, q_seg, k_seg))
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  first, last = _kv_range(st, i, bq, bk)
  dq = lax.fori_loop(first, last + 1, step, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _params(head_dim):
  return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def _seg_specs(seg, kv_seg, q_block, q_index):
  if seg is None:
    return [None, None]
  return [pl.BlockSpec((None, q_block), q_index),
          pl.BlockSpec((None, kv_seg.shape[1]), lambda a, b, c: (b, 0))]


def _forward(q, k, v, q_seg, kv_seg, st):
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group, bq = num_heads // num_kv_heads, st.block_q
  q_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
  kv_spec = pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
  o, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, st=st),
      grid=(q_len // bq, batch, num_heads),
      in_specs=[q_spec, kv_spec, kv_spec, *_seg_specs(q_seg, kv_seg, bq, lambda i, b, h: (b, i))],
      out_specs=[q_spec, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)],
      compiler_params=_params(head_dim),
      interpret=st.interpret,
      name="flash_attention_fwd",
  )(q, k, v, q_seg, kv_seg)
  return o, lse


def _backward(q, k, v, q_seg, kv_seg, o, lse, do, st):
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group, bq, bk = num_heads // num_kv_heads, st.block_q_bwd, st.block_k_bwd
  delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))

  group_spec = pl.BlockSpec((None, q_len, group, head_dim), lambda j, b, h: (b, 0, h, 0))
  stat_spec = pl.BlockSpec((None, group, q_len), lambda j, b, h: (b, h, 0))
  kv_spec = pl.BlockSpec((None, bk, None, head_dim), lambda j, b, h: (b, j, h, 0))
  seg_specs = [None, None]
  if q_seg is not None:
    seg_specs = [pl.BlockSpec((None, q_len), lambda j, b, h: (b, 0)),
                 pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, st=st, group=group, num_q_blocks=q_len // bq),
      grid=(kv_len // bk, batch, num_kv_heads),
      in_specs=[group_spec, kv_spec, kv_spec, group_spec, stat_spec, stat_spec, *seg_specs],
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(head_dim),
      interpret=st.interpret,
      name="flash_attention_dkv",
  )(q, k, v, do, lse, delta, q_seg, kv_seg)

  q_spec = pl.BlockSpec((None, bq, None, head_dim), lambda i, b, h: (b, i, h, 0))
  row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  kv_spec = pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, h // group, 0))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st),
      grid=(q_len // bq, batch, num_heads),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                *_seg_specs(q_seg, kv_seg, bq, lambda i, b, h: (b, i))],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_params(head_dim),
      interpret=st.interpret,
      name="flash_attention_dq",
  )(q, k, v, do, lse, delta, q_seg, kv_seg)
  return dq, dk, dv


# Kernels take `st` last; the shared VJP passes it first.
_flash = with_lse_vjp(lambda st, *args: _forward(*args, st), lambda st, *args: _backward(*args, st))


def flash_attention_gpu(q, k, v, *, segment_ids=None, causal=True, sliding_window=None,
                        logit_soft_cap=None, scale=None, block_sizes=None, interpret=False):
  """q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] -> [B, Lq, Hq, D] (Triton kernel)."""
  validation.check_attention_args(q, k, v, segment_ids, sliding_window, logit_soft_cap)
  blocks = block_sizes or default_block_sizes("gpu")
  q_len, kv_len = q.shape[1], k.shape[1]
  tiles = tiling.fit_tiles(blocks, q_len, kv_len, 16, power_of_two=True)
  tiles = {n: 1 << (t - 1).bit_length() for n, t in tiles.items()}  # Triton: powers of two
  q_pad = tiling.round_up(q_len, max(tiles["block_q"], tiles["block_q_bwd"]))
  kv_pad = tiling.round_up(kv_len, max(tiles["block_k"], tiles["block_k_bwd"]))
  st = _Static(causal=causal, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
               scale=q.shape[-1] ** -0.5 if scale is None else scale,
               q_offset=kv_len - q_len, kv_len=kv_len, interpret=interpret, **tiles)
  q_seg, kv_seg = tiling.padded_segments(segment_ids, q_len, q_pad, kv_pad)
  pad = lambda x, n: tiling.pad_axis(x, 1, n)
  o = _flash(st, pad(q, q_pad), pad(k, kv_pad), pad(v, kv_pad), q_seg, kv_seg)
  return o[:, :q_len]
