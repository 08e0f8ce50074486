"""FlashAttention-2 for GPU (Pallas Triton backend): forward with online softmax,
backward as a dK/dV kernel and a dQ kernel that recompute from the log-sum-exp.

Works on [batch, length, heads, head_dim] directly (Triton loads strided tiles).
A query tile is one head; the K/V index map sends query head h to kv head
h // group, and the dK/dV kernel loops over the group, so K/V are never repeated.
Attention sinks start each row's online softmax at (max = sink, sum = 1); the backward
kernels see them through the saved log-sum-exp.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.attention import masking, validation
from jaxpar.pallas_kernels.attention.block_sizes import default_block_sizes
from jaxpar.pallas_kernels.attention.blockwise import Blockwise, Tiled, default_offset, out_struct, split_segments
from jaxpar.pallas_kernels.attention.lse_vjp import with_lse_vjp
from jaxpar.pallas_kernels.attention.spec import AttentionSpec


def _mask(st, offset, i, j, bq, bk, q_seg, k_seg):
  q_pos = offset + i * bq + jnp.arange(bq)[:, None]
  k_pos = j * bk + jnp.arange(bk)[None, :]
  segs = {} if q_seg is None else dict(q_seg=q_seg[:, None], k_seg=k_seg[None, :])
  return masking.token_mask(q_pos, k_pos, st.mask, kv_len=st.kv_len, **segs)


def _kv_range(st, offset, i, bq, bk):
  q_lo = offset + i * bq
  return masking.kv_block_range(q_lo, q_lo + bq - 1, bk, st.mask, kv_len=st.kv_len)


def _fwd_kernel(off_ref, q_ref, k_ref, v_ref, seg_ref, kv_seg_ref, sink_ref, o_ref, lse_ref, *, st):
  bq, bk = st.block_q, st.block_k
  i, offset = pl.program_id(0), off_ref[0]
  q = q_ref[...]
  q_seg = None if seg_ref is None else seg_ref[...]

  def step(j, carry):
    m, l, acc = carry
    ks = pl.ds(j * bk, bk)
    s = plgpu.dot(q, k_ref[ks, :], trans_b=True) * st.scale
    k_seg = None if kv_seg_ref is None else kv_seg_ref[ks]
    mask = _mask(st, offset, i, j, bq, bk, q_seg, k_seg)
    s = jnp.where(mask, masking.soft_cap(s, st.logit_soft_cap), masking.MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=1))
    p = jnp.exp(s - m_next[:, None])
    alpha = jnp.exp(m - m_next)
    v = v_ref[ks, :]
    acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
    return m_next, alpha * l + p.sum(axis=1), acc

  first, last = _kv_range(st, offset, i, bq, bk)
  if sink_ref is None:
    m, l = jnp.full((bq,), masking.MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32)
  else:  # the sink: a first key of value zero
    m, l = jnp.full((bq,), sink_ref[0], jnp.float32), jnp.ones((bq,), jnp.float32)
  init = (m, l, jnp.zeros((bq, v_ref.shape[-1]), jnp.float32))
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


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, kv_seg_ref,
                dk_ref, dv_ref, *, st, group, num_q_blocks):
  bq, bk = st.block_q_bwd, st.block_k_bwd
  j, offset = pl.program_id(0), off_ref[0]
  k, v = k_ref[...], v_ref[...]
  k_seg = None if kv_seg_ref is None else kv_seg_ref[...]
  first, last = masking.q_block_range(j * bk, j * bk + bk - 1, bq, num_q_blocks, st.mask, q_offset=offset)

  def step(i, carry, g):
    dk, dv = carry
    qs = pl.ds(i * bq, bq)
    q, do = q_ref[qs, g, :], do_ref[qs, g, :]
    q_seg = None if seg_ref is None else seg_ref[qs]
    mask = _mask(st, offset, i, j, bq, bk, q_seg, k_seg)
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


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, seg_ref, kv_seg_ref,
               dq_ref, *, st):
  bq, bk = st.block_q_bwd, st.block_k_bwd
  i, offset = pl.program_id(0), off_ref[0]
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  q_seg = None if seg_ref is None else seg_ref[...]

  def step(j, dq):
    ks = pl.ds(j * bk, bk)
    k = k_ref[ks, :]
    k_seg = None if kv_seg_ref is None else kv_seg_ref[ks]
    mask = _mask(st, offset, i, j, bq, bk, q_seg, k_seg)
    _, ds = _bwd_tile(st, q, k, v_ref[ks, :], do, lse, delta, mask)
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  first, last = _kv_range(st, offset, i, bq, bk)
  dq = lax.fori_loop(first, last + 1, step, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


# Measured on an H200 at B4 L4096 Hq32 Hkv8 D128 causal bf16 (docs/benchmarks.md#gpu): 64 x 64
# tiles with 4 warps ran the forward in 1.83 ms with 3 pipeline stages (8 warps: 3.1 ms) and
# the backward in 4.9 ms with 2 (8 warps on 32 x 32 tiles, the earlier default: 21 ms).
_FORWARD_PARAMS = dict(num_warps=4, num_stages=3)
_BACKWARD_PARAMS = dict(num_warps=4, num_stages=2)


def _seg_specs(seg, kv_seg, q_block, q_index):
  if seg is None:
    return [None, None]
  return [pl.BlockSpec((None, q_block), q_index),
          pl.BlockSpec((None, kv_seg.shape[1]), lambda a, b, c: (b, 0))]


# The query offset, a 1-element int32 operand every program reads.
_OFFSET_SPEC = pl.BlockSpec((1,), lambda *grid: (0,))


def _forward(q, k, v, sinks, q_seg, kv_seg, offset, st):
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group, bq = num_heads // num_kv_heads, st.block_q
  q_spec, o_spec = (pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))
                    for d in (head_dim, v.shape[-1]))
  k_spec, v_spec = (pl.BlockSpec((None, kv_len, None, d), lambda i, b, h: (b, 0, h // group, 0))
                    for d in (head_dim, v.shape[-1]))
  sink_spec = None if sinks is None else pl.BlockSpec((1,), lambda i, b, h: (h,))  # this head's
  o, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, st=st),
      grid=(q_len // bq, batch, num_heads),
      in_specs=[_OFFSET_SPEC, q_spec, k_spec, v_spec,
                *_seg_specs(q_seg, kv_seg, bq, lambda i, b, h: (b, i)), sink_spec],
      out_specs=[o_spec, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
      out_shape=[out_struct((*q.shape[:3], v.shape[-1]), q.dtype, q),
                 out_struct((batch, num_heads, q_len), jnp.float32, q)],
      compiler_params=plgpu.CompilerParams(**_FORWARD_PARAMS),
      interpret=st.interpret,
      name="flash_attention_fwd",
  )(offset, q, k, v, q_seg, kv_seg, None if sinks is None else sinks.astype(jnp.float32))
  return o, lse


def _backward(q, k, v, q_seg, kv_seg, offset, o, lse, do, st):
  batch, q_len, num_heads, head_dim = q.shape
  kv_len, num_kv_heads = k.shape[1], k.shape[2]
  group, bq, bk = num_heads // num_kv_heads, st.block_q_bwd, st.block_k_bwd
  delta = jnp.einsum("bqhd,bqhd->bhq", o.astype(jnp.float32), do.astype(jnp.float32))

  value_dim = v.shape[-1]
  q_group, do_group = (pl.BlockSpec((None, q_len, group, d), lambda j, b, h: (b, 0, h, 0))
                       for d in (head_dim, value_dim))
  stat_spec = pl.BlockSpec((None, group, q_len), lambda j, b, h: (b, h, 0))
  k_spec, v_spec = (pl.BlockSpec((None, bk, None, d), lambda j, b, h: (b, j, h, 0))
                    for d in (head_dim, value_dim))
  seg_specs = [None, None]
  if q_seg is not None:
    seg_specs = [pl.BlockSpec((None, q_len), lambda j, b, h: (b, 0)),
                 pl.BlockSpec((None, bk), lambda j, b, h: (b, j))]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, st=st, group=group, num_q_blocks=q_len // bq),
      grid=(kv_len // bk, batch, num_kv_heads),
      in_specs=[_OFFSET_SPEC, q_group, k_spec, v_spec, do_group, stat_spec, stat_spec,
                *seg_specs],
      out_specs=[k_spec, v_spec],
      out_shape=[out_struct(k.shape, k.dtype, k), out_struct(v.shape, v.dtype, v)],
      compiler_params=plgpu.CompilerParams(**_BACKWARD_PARAMS),
      interpret=st.interpret,
      name="flash_attention_dkv",
  )(offset, q, k, v, do, lse, delta, q_seg, kv_seg)

  q_spec, do_spec = (pl.BlockSpec((None, bq, None, d), lambda i, b, h: (b, i, h, 0))
                     for d in (head_dim, value_dim))
  row_spec = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
  k_spec, v_spec = (pl.BlockSpec((None, kv_len, None, d), lambda i, b, h: (b, 0, h // group, 0))
                    for d in (head_dim, value_dim))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st),
      grid=(q_len // bq, batch, num_heads),
      in_specs=[_OFFSET_SPEC, q_spec, k_spec, v_spec, do_spec, row_spec, row_spec,
                *_seg_specs(q_seg, kv_seg, bq, lambda i, b, h: (b, i))],
      out_specs=q_spec,
      out_shape=out_struct(q.shape, q.dtype, q),
      compiler_params=plgpu.CompilerParams(**_BACKWARD_PARAMS),
      interpret=st.interpret,
      name="flash_attention_dq",
  )(offset, q, k, v, do, lse, delta, q_seg, kv_seg)
  return dq, dk, dv


def _static(spec, q, k):
  """(kernel statics, padded q length, padded kv length) for these shapes."""
  st = Tiled.fit(spec, default_block_sizes("gpu"), q, k, 16, power_of_two=True)
  q_pad = tiling.round_up(q.shape[1], max(st.block_q, st.block_q_bwd))
  kv_pad = tiling.round_up(k.shape[1], max(st.block_k, st.block_k_bwd))
  return st, q_pad, kv_pad


def _offset(q_offset):
  return jnp.reshape(q_offset, (1,)).astype(jnp.int32)


def _padded(x, length):
  """[B, L, H, D] zero-padded to `length` positions and to a power-of-two head dim (Triton
  tiles are powers of two; zeros add nothing to q.k or to the values: a head dim of 192,
  as multi-head latent attention's queries and keys have, runs as 256)."""
  return tiling.pad_axis(tiling.pad_axis(x, 1, length), 3, 1 << (x.shape[3] - 1).bit_length())


def forward(spec, q, k, v, sinks, q_seg, kv_seg, q_offset):
  """The blockwise forward (see blockwise.py): (o [B, Lq, Hq, Dv], lse [B, Hq, Lq])."""
  q_len = q.shape[1]
  st, q_pad, kv_pad = _static(spec, q, k)
  q_seg, kv_seg = tiling.padded_segments(q_seg, kv_seg, q_pad, kv_pad)
  o, lse = _forward(_padded(q, q_pad), _padded(k, kv_pad), _padded(v, kv_pad), sinks, q_seg, kv_seg,
                    _offset(q_offset), st)
  return o[:, :q_len, :, :v.shape[3]], lse[:, :, :q_len]


def backward(spec, q, k, v, q_seg, kv_seg, q_offset, o, lse, do):
  """The blockwise backward from a given log-sum-exp (see blockwise.py): (dq, dk, dv)."""
  q_len, kv_len = q.shape[1], k.shape[1]
  st, q_pad, kv_pad = _static(spec, q, k)
  q_seg, kv_seg = tiling.padded_segments(q_seg, kv_seg, q_pad, kv_pad)
  dq, dk, dv = _backward(_padded(q, q_pad), _padded(k, kv_pad), _padded(v, kv_pad), q_seg, kv_seg,
                         _offset(q_offset), _padded(o, q_pad), tiling.pad_axis(lse, 2, q_pad),
                         _padded(do, q_pad), st)
  head, value = q.shape[3], v.shape[3]
  return dq[:, :q_len, :, :head], dk[:, :kv_len, :, :head], dv[:, :kv_len, :, :value]


BLOCKWISE = Blockwise(forward, backward)
_flash = with_lse_vjp(forward, backward)


def flash_attention_gpu(q, k, v, spec: AttentionSpec = AttentionSpec(), *, segment_ids=None, sinks=None):
  """q: [B, Lq, Hq, D]; k: [B, Lk, Hkv, D]; v: [B, Lk, Hkv, Dv]; sinks [Hq] or None
  -> [B, Lq, Hq, Dv] (Triton kernel)."""
  validation.check_attention_args(q, k, v, segment_ids, sinks=sinks)
  return _flash(spec, q, k, v, sinks, *split_segments(segment_ids, q.shape[1]), default_offset(q, k))
