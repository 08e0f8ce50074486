"""FlashAttention-2 for TPU (Mosaic): tiled forward with online softmax, backward as
two kernels (dK/dV, then dQ) that recompute probabilities from the saved log-sum-exp.

Layout inside: [batch, heads, length, head_dim], so a (length, head_dim) tile is one
VMEM block. One grid step handles all `group` query heads of one kv head, so K/V
tiles are loaded once per group and never repeated in HBM (GQA/MQA), and dK/dV
accumulate over the group without a cross-step reduction. The query offset is a
prefetched scalar (SMEM), so context parallelism can pair blocks whose relative position
is only known on the device; tiles it masks entirely are skipped, DMA included. Attention
sinks (one logit per query head, in SMEM) start each row's online softmax at (max = sink,
sum = 1); the backward kernels read them through the saved log-sum-exp.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.attention import masking, tpu_segments, validation
from jaxpar.pallas_kernels.attention.block_sizes import default_block_sizes
from jaxpar.pallas_kernels.attention.blockwise import (Blockwise, Tiled, default_offset,
                                                       out_struct, split_segments)
from jaxpar.pallas_kernels.attention.lse_vjp import with_lse_vjp
from jaxpar.pallas_kernels.attention.spec import AttentionSpec
from jaxpar.pallas_kernels.tpu_matmul import mxu_dot

_LANES = tpu_segments.LANES


def _tile_mask(st, q_lo, k_lo, bq, bk, qseg, kseg, transposed):
  """Mask for a [bq, bk] tile (or [bk, bq] when transposed) of logits."""
  shape = (bk, bq) if transposed else (bq, bk)
  q_axis, k_axis = (1, 0) if transposed else (0, 1)
  q_pos = q_lo + lax.broadcasted_iota(jnp.int32, shape, q_axis)
  k_pos = k_lo + lax.broadcasted_iota(jnp.int32, shape, k_axis)
  return masking.token_mask(q_pos, k_pos, st.mask, kv_len=st.kv_len, q_seg=qseg, k_seg=kseg)


def _kv_range(st, offset, i, bq, bk):
  q_lo = offset + i * bq
  return masking.kv_block_range(q_lo, q_lo + bq - 1, bk, st.mask, kv_len=st.kv_len)


def _q_range(st, offset, j, bq, bk, num_q_blocks):
  return masking.q_block_range(j * bk, j * bk + bk - 1, bq, num_q_blocks, st.mask, q_offset=offset)


def _live(index, first, last, count):
  """The block to fetch at grid step `index`: itself when live, else a neighbour that is
  (so a skipped step re-uses the last DMA), always inside [0, count)."""
  return jnp.clip(jnp.clip(index, first, last), 0, count - 1)


def _fwd_kernel(off_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, sinks_ref, o_ref, lse_ref, m_scr,
                l_scr, acc_scr, *, st, group):
  bq, bk = st.block_q, st.block_k
  h, i, j = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  offset = off_ref[0]

  @pl.when(j == 0)
  def _init():
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
    if sinks_ref is None:
      m_scr[...] = jnp.full(m_scr.shape, masking.MASK_VALUE, jnp.float32)
      l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
      return
    for g in range(group):  # the sink: a first key of value zero
      m_scr[g] = jnp.full(m_scr.shape[1:], sinks_ref[h * group + g], jnp.float32)
      l_scr[g] = jnp.ones(l_scr.shape[1:], jnp.float32)

  first, last = _kv_range(st, offset, i, bq, bk)

  @pl.when((j >= first) & (j <= last))
  def _step():
    k, v = k_ref[...], v_ref[...]
    qseg, kseg = tpu_segments.tile_ids(qseg_ref, kseg_ref)
    mask = _tile_mask(st, offset + i * bq, j * bk, bq, bk, qseg, kseg, transposed=False)
    for g in range(group):
      s = mxu_dot(q_ref[g], k, trans_b=True) * st.scale
      s = jnp.where(mask, masking.soft_cap(s, st.logit_soft_cap), masking.MASK_VALUE)
      m_prev = m_scr[g]
      m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
      p = jnp.exp(s - m_next[:, :1])
      alpha = jnp.exp(m_prev - m_next)
      l_scr[g] = alpha * l_scr[g] + p.sum(axis=1, keepdims=True)
      pv = mxu_dot(p.astype(v.dtype), v)
      acc_scr[g] = acc_scr[g] * alpha[:, :1] + pv
      m_scr[g] = m_next

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    for g in range(group):
      # Rows that saw no key (only block padding) get l == 0: keep them finite.
      l = l_scr[g]
      l = jnp.where(l == 0.0, 1.0, l)
      o_ref[g] = (acc_scr[g] / l[:, :1]).astype(o_ref.dtype)
      # Stored as a lane-major row [1, bq] (the scratch holds it down a column, copied across
      # lanes): an f32 [B, H, L, 128] residual would cost as much HBM as the output itself.
      lse_ref[g] = jnp.transpose(m_scr[g] + jnp.log(l))[:1]


def _bwd_tile(st, q, k, v, do, lse, delta, mask):
  """Transposed [bk, bq] tile of probabilities and d(logits) for one query head."""
  raw = mxu_dot(k, q, trans_b=True) * st.scale
  capped = masking.soft_cap(raw, st.logit_soft_cap)
  pt = jnp.exp(jnp.where(mask, capped, masking.MASK_VALUE) - lse)
  dpt = mxu_dot(v, do, trans_b=True)
  dst = pt * (dpt - delta) * masking.soft_cap_grad(capped, st.logit_soft_cap)
  return pt, dst


def _dkv_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref,
                dk_ref, dv_ref, dk_scr, dv_scr, *, st, group):
  bq, bk = st.block_q_bwd, st.block_k_bwd
  j, i = pl.program_id(2), pl.program_id(3)
  offset = off_ref[0]

  @pl.when(i == 0)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  first, last = _q_range(st, offset, j, bq, bk, pl.num_programs(3))

  @pl.when((i >= first) & (i <= last))
  def _step():
    k, v = k_ref[...], v_ref[...]
    kseg, qseg = tpu_segments.tile_ids(kseg_ref, qseg_ref)
    mask = _tile_mask(st, offset + i * bq, j * bk, bq, bk, qseg, kseg, transposed=True)
    for g in range(group):
      q, do = q_ref[g], do_ref[g]
      pt, dst = _bwd_tile(st, q, k, v, do, lse_ref[g], delta_ref[g], mask)
      dv_scr[...] += mxu_dot(pt.astype(do.dtype), do)
      dk_scr[...] += mxu_dot(dst.astype(q.dtype), q)

  @pl.when(i == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = (dk_scr[...] * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref,
               dq_ref, dq_scr, *, st, group):
  bq, bk = st.block_q_bwd, st.block_k_bwd
  i, j = pl.program_id(2), pl.program_id(3)
  offset = off_ref[0]

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  first, last = _kv_range(st, offset, i, bq, bk)

  @pl.when((j >= first) & (j <= last))
  def _step():
    k, v = k_ref[...], v_ref[...]
    kseg, qseg = tpu_segments.tile_ids(kseg_ref, qseg_ref)
    mask = _tile_mask(st, offset + i * bq, j * bk, bq, bk, qseg, kseg, transposed=True)
    for g in range(group):
      _, dst = _bwd_tile(st, q_ref[g], k, v, do_ref[g], lse_ref[g], delta_ref[g], mask)
      dq_scr[g] += mxu_dot(dst.T.astype(k.dtype), k)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * st.scale).astype(dq_ref.dtype)


def _cost(q, k, v, st, passes):
  """`passes` matmuls over every (query, key) pair, each of the mean of the q/k and v head
  dims (they differ under multi-head latent attention); halved for a causal mask."""
  batch, heads, q_len, _ = q.shape
  scores = batch * heads * q_len * k.shape[2] // (2 if st.mask.causal else 1)
  flops = passes * scores * (q.shape[-1] + v.shape[-1])
  nbytes = sum(x.size * x.dtype.itemsize for x in (q, k, v)) * 2
  return pl.CostEstimate(flops=flops, transcendentals=scores, bytes_accessed=nbytes)


def _call(kernel, st, group, grid, in_specs, out_specs, out_shape, scratch, cost, name):
  """pallas_call with the query offset as a prefetched scalar: index maps get it last,
  kernels first."""
  spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=in_specs,
                                      out_specs=out_specs, scratch_shapes=scratch)
  params = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3 + ("arbitrary",),
                                vmem_limit_bytes=st.spec.block_sizes.vmem_limit_bytes)
  return pl.pallas_call(functools.partial(kernel, st=st, group=group), grid_spec=spec,
                        out_shape=out_shape, compiler_params=params, cost_estimate=cost,
                        interpret=st.interpret, name=name)


def _forward(q, k, v, sinks, q_seg, kv_seg, offset, st):
  """Kernel layout: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], sinks f32 [Hq]
  or None -> (o [B, Hq, Lq, Dv], lse [B, Hq, Lq])."""
  batch, num_heads, q_len, _ = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  bq, bk = st.block_q, st.block_k
  value_dim = v.shape[-1]

  def kv_block(i, j, off):
    return _live(j, *_kv_range(st, off[0], i, bq, bk), kv_len // bk)

  q_spec, o_spec = (pl.BlockSpec((None, group, bq, d), lambda b, h, i, j, off: (b, h, i, 0))
                    for d in (q.shape[-1], value_dim))
  k_spec, v_spec = (pl.BlockSpec((None, None, bk, d), lambda b, h, i, j, off: (b, h, kv_block(i, j, off), 0))
                    for d in (k.shape[-1], value_dim))
  seg_specs = [None, None]
  if q_seg is not None:
    seg_specs = [tpu_segments.column_spec(bq, lambda b, h, i, j, off: i),
                 tpu_segments.row_spec(bk, lambda b, h, i, j, off: kv_block(i, j, off))]
  lse_spec = pl.BlockSpec((None, group, 1, bq), lambda b, h, i, j, off: (b, h, 0, i))
  sinks_spec = None if sinks is None else pl.BlockSpec(memory_space=pltpu.SMEM)
  o, lse = _call(
      _fwd_kernel, st, group, (batch, num_kv_heads, q_len // bq, kv_len // bk),
      [q_spec, k_spec, v_spec, *seg_specs, sinks_spec], [o_spec, lse_spec],
      [out_struct((*q.shape[:3], value_dim), q.dtype, q),
       out_struct((batch, num_heads, 1, q_len), jnp.float32, q)],
      [pltpu.VMEM((group, bq, _LANES), jnp.float32), pltpu.VMEM((group, bq, _LANES), jnp.float32),
       pltpu.VMEM((group, bq, value_dim), jnp.float32)],
      _cost(q, k, v, st, passes=2), "flash_attention_fwd",
  )(offset, q, k, v, tpu_segments.layout(q_seg, True), tpu_segments.layout(kv_seg, False),
    None if sinks is None else sinks.astype(jnp.float32))
  return o, lse[:, :, 0]


def _backward(q, k, v, q_seg, kv_seg, offset, o, lse, do, st):
  batch, num_heads, q_len, head_dim = q.shape
  value_dim = v.shape[-1]
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  bq, bk = st.block_q_bwd, st.block_k_bwd
  num_q_blocks, num_k_blocks = q_len // bq, kv_len // bk
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  # Per-row statistics as lane-major rows: they broadcast over a transposed tile.
  lse, delta = lse[:, :, None, :], delta[:, :, None, :]
  q_segs = tpu_segments.layout(q_seg, False)
  kv_segs = tpu_segments.layout(kv_seg, True)

  # dK, dV: kv tile fixed, sweep the query tiles that can see it.
  def q_block(j, i, off):
    return _live(i, *_q_range(st, off[0], j, bq, bk, num_q_blocks), num_q_blocks)

  q_spec, do_spec = (pl.BlockSpec((None, group, bq, d), lambda b, h, j, i, off: (b, h, q_block(j, i, off), 0))
                     for d in (head_dim, value_dim))
  row_spec = pl.BlockSpec((None, group, 1, bq), lambda b, h, j, i, off: (b, h, 0, q_block(j, i, off)))
  k_spec, v_spec = (pl.BlockSpec((None, None, bk, d), lambda b, h, j, i, off: (b, h, j, 0))
                    for d in (head_dim, value_dim))
  seg_specs = [None, None]
  if q_seg is not None:
    seg_specs = [tpu_segments.row_spec(bq, lambda b, h, j, i, off: q_block(j, i, off)),
                 tpu_segments.column_spec(bk, lambda b, h, j, i, off: j)]
  dk, dv = _call(
      _dkv_kernel, st, group, (batch, num_kv_heads, num_k_blocks, num_q_blocks),
      [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec, *seg_specs], [k_spec, v_spec],
      [out_struct(k.shape, k.dtype, k), out_struct(v.shape, v.dtype, v)],
      [pltpu.VMEM((bk, head_dim), jnp.float32), pltpu.VMEM((bk, value_dim), jnp.float32)],
      _cost(q, k, v, st, passes=4), "flash_attention_dkv",
  )(offset, q, k, v, do, lse, delta, q_segs, kv_segs)

  # dQ: query tile fixed, sweep the kv tiles it can see.
  def kv_block(i, j, off):
    return _live(j, *_kv_range(st, off[0], i, bq, bk), num_k_blocks)

  q_spec, do_spec = (pl.BlockSpec((None, group, bq, d), lambda b, h, i, j, off: (b, h, i, 0))
                     for d in (head_dim, value_dim))
  row_spec = pl.BlockSpec((None, group, 1, bq), lambda b, h, i, j, off: (b, h, 0, i))
  k_spec, v_spec = (pl.BlockSpec((None, None, bk, d), lambda b, h, i, j, off: (b, h, kv_block(i, j, off), 0))
                    for d in (head_dim, value_dim))
  seg_specs = [None, None]
  if q_seg is not None:
    seg_specs = [tpu_segments.row_spec(bq, lambda b, h, i, j, off: i),
                 tpu_segments.column_spec(bk, lambda b, h, i, j, off: kv_block(i, j, off))]
  dq = _call(
      _dq_kernel, st, group, (batch, num_kv_heads, num_q_blocks, num_k_blocks),
      [q_spec, k_spec, v_spec, do_spec, row_spec, row_spec, *seg_specs], q_spec,
      out_struct(q.shape, q.dtype, q), [pltpu.VMEM((group, bq, head_dim), jnp.float32)],
      _cost(q, k, v, st, passes=3), "flash_attention_dq",
  )(offset, q, k, v, do, lse, delta, q_segs, kv_segs)
  return dq, dk, dv


def _blocks(head_dim):
  """This chip generation's default tiles (and VMEM limit) for heads this wide."""
  return default_block_sizes("tpu", _device_kind(), head_dim)


def _prepare(spec, q, k, q_seg, kv_seg, q_offset):
  """Kernel statics, a padder to the kernel layout for queries / keys ([B, L, H, D] ->
  [B, H, L_pad, D]), the padded segment ids and the offset as a prefetchable [1]."""
  spec = spec if spec.block_sizes else spec.replace(block_sizes=_blocks(q.shape[-1]))  # _call reads its VMEM limit
  st = Tiled.fit(spec, spec.block_sizes, q, k, _LANES)
  q_pad = tiling.round_up(q.shape[1], math.lcm(st.block_q, st.block_q_bwd))
  kv_pad = tiling.round_up(k.shape[1], math.lcm(st.block_k, st.block_k_bwd))
  pad = lambda x, n: tiling.pad_axis(x, 1, n).transpose(0, 2, 1, 3)
  segs = tiling.padded_segments(q_seg, kv_seg, q_pad, kv_pad)
  return (st, lambda x: pad(x, q_pad), lambda x: pad(x, kv_pad), segs,
          jnp.reshape(q_offset, (1,)).astype(jnp.int32))


def _from_kernel(x, length):
  return x.transpose(0, 2, 1, 3)[:, :length]


def forward(spec, q, k, v, sinks, q_seg, kv_seg, q_offset):
  """The blockwise forward (see blockwise.py): (o [B, Lq, Hq, D], lse [B, Hq, Lq])."""
  st, pad_q, pad_kv, segs, offset = _prepare(spec, q, k, q_seg, kv_seg, q_offset)
  o, lse = _forward(pad_q(q), pad_kv(k), pad_kv(v), sinks, *segs, offset, st)
  return _from_kernel(o, q.shape[1]), lse[:, :, :q.shape[1]]


def backward(spec, q, k, v, q_seg, kv_seg, q_offset, o, lse, do):
  """The blockwise backward from a given log-sum-exp (see blockwise.py): (dq, dk, dv)."""
  st, pad_q, pad_kv, segs, offset = _prepare(spec, q, k, q_seg, kv_seg, q_offset)
  lse = tiling.pad_axis(lse, 2, pad_q(q).shape[2])
  dq, dk, dv = _backward(pad_q(q), pad_kv(k), pad_kv(v), *segs, offset, pad_q(o), lse, pad_q(do), st)
  return _from_kernel(dq, q.shape[1]), _from_kernel(dk, k.shape[1]), _from_kernel(dv, k.shape[1])


BLOCKWISE = Blockwise(forward, backward)
_flash = with_lse_vjp(forward, backward)


def flash_attention_tpu(q, k, v, spec: AttentionSpec = AttentionSpec(), *, segment_ids=None, sinks=None):
  """q: [B, Lq, Hq, D]; k: [B, Lk, Hkv, D]; v: [B, Lk, Hkv, Dv]; sinks [Hq] or None
  -> [B, Lq, Hq, Dv] (Mosaic TPU kernel).

  Sequences that are not a multiple of the tile are zero-padded; padded keys are
  masked and padded queries are dropped, so their gradients vanish.
  """
  validation.check_attention_args(q, k, v, segment_ids, sinks=sinks,
                                  head_dims=validation.flash_head_dims("tpu", _device_kind()))
  return _flash(spec, q, k, v, sinks, *split_segments(segment_ids, q.shape[1]), default_offset(q, k))


def _device_kind():
  device = jax.devices()[0]
  return device.device_kind if device.platform == "tpu" else ""
