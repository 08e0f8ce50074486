"""FlashAttention-2 for TPU (Mosaic): tiled forward with online softmax, backward as
two kernels (dK/dV, then dQ) that recompute probabilities from the saved log-sum-exp.

Layout inside: [batch, heads, length, head_dim], so a (length, head_dim) tile is one
VMEM block. One grid step handles all `group` query heads of one kv head, so K/V
tiles are loaded once per group and never repeated in HBM (GQA/MQA), and dK/dV
accumulate over the group without a cross-step reduction.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.attention import masking, validation
from jaxpar.pallas_kernels.attention.block_sizes import default_block_sizes
from jaxpar.pallas_kernels.attention.lse_vjp import with_lse_vjp
from jaxpar.pallas_kernels.tpu_matmul import mxu_dot

_LANES = 128
_SUBLANES = 8


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the kernels specialise on (hashable: a nondiff custom_vjp arg)."""
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
  vmem_limit_bytes: int | None
  interpret: bool


def _tile_mask(st, q_lo, k_lo, bq, bk, qseg, kseg, transposed):
  """Mask for a [bq, bk] tile (or [bk, bq] when transposed) of logits."""
  shape = (bk, bq) if transposed else (bq, bk)
  q_axis, k_axis = (1, 0) if transposed else (0, 1)
  q_pos = q_lo + lax.broadcasted_iota(jnp.int32, shape, q_axis)
  k_pos = k_lo + lax.broadcasted_iota(jnp.int32, shape, k_axis)
  return masking.token_mask(q_pos, k_pos, causal=st.causal, sliding_window=st.sliding_window,
                            kv_len=st.kv_len, q_seg=qseg, k_seg=kseg)


def _kv_range(st, i, bq, bk):
  q_lo = st.q_offset + i * bq
  return masking.kv_block_range(q_lo, q_lo + bq - 1, bk, causal=st.causal,
                                sliding_window=st.sliding_window, kv_len=st.kv_len)


def _q_range(st, j, bq, bk, num_q_blocks):
  return masking.q_block_range(j * bk, j * bk + bk - 1, bq, num_q_blocks, q_offset=st.q_offset,
                               causal=st.causal, sliding_window=st.sliding_window)


def _segments(qseg_ref, kseg_ref):
  """Column of query ids and row of key ids (or None): they broadcast to a tile."""
  if qseg_ref is None:
    return None, None
  return qseg_ref[:, :1], kseg_ref[:1, :]


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr,
                *, st, group):
  bq, bk = st.block_q, st.block_k
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, masking.MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  first, last = _kv_range(st, i, bq, bk)

  @pl.when((j >= first) & (j <= last))
  def _step():
    k, v = k_ref[...], v_ref[...]
    qseg, kseg = _segments(qseg_ref, kseg_ref)
    mask = _tile_mask(st, st.q_offset + i * bq, j * bk, bq, bk, qseg, kseg, transposed=False)
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
      lse_ref[g] = m_scr[g] + jnp.log(l)


def _bwd_tile(st, q, k, v, do, lse, delta, mask):
  """Transposed [bk, bq] tile of probabilities and d(logits) for one query head."""
  raw = mxu_dot(k, q, trans_b=True) * st.scale
  capped = masking.soft_cap(raw, st.logit_soft_cap)
  pt = jnp.exp(jnp.where(mask, capped, masking.MASK_VALUE) - lse)
  dpt = mxu_dot(v, do, trans_b=True)
  dst = pt * (dpt - delta) * masking.soft_cap_grad(capped, st.logit_soft_cap)
  return pt, dst


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref,
                dk_ref, dv_ref, dk_scr, dv_scr, *, st, group):
  bq, bk = st.block_q_bwd, st.block_k_bwd
  j, i = pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  first, last = _q_range(st, j, bq, bk, pl.num_programs(3))

  @pl.when((i >= first) & (i <= last))
  def _step():
    k, v = k_ref[...], v_ref[...]
    kseg, qseg = _segments(kseg_ref, qseg_ref)
    mask = _tile_mask(st, st.q_offset + i * bq, j * bk, bq, bk, qseg, kseg, transposed=True)
    for g in range(group):
      q, do = q_ref[g], do_ref[g]
      pt, dst = _bwd_tile(st, q, k, v, do, lse_ref[g], delta_ref[g], mask)
      dv_scr[...] += mxu_dot(pt.astype(do.dtype), do)
      dk_scr[...] += mxu_dot(dst.astype(q.dtype), q)

  @pl.when(i == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = (dk_scr[...] * st.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref,
               dq_ref, dq_scr, *, st, group):
  bq, bk = st.block_q_bwd, st.block_k_bwd
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  first, last = _kv_range(st, i, bq, bk)

  @pl.when((j >= first) & (j <= last))
  def _step():
    k, v = k_ref[...], v_ref[...]
    kseg, qseg = _segments(kseg_ref, qseg_ref)
    mask = _tile_mask(st, st.q_offset + i * bq, j * bk, bq, bk, qseg, kseg, transposed=True)
    for g in range(group):
      _, dst = _bwd_tile(st, q_ref[g], k, v, do_ref[g], lse_ref[g], delta_ref[g], mask)
      dq_scr[g] += mxu_dot(dst.T.astype(k.dtype), k)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_scr[...] * st.scale).astype(dq_ref.dtype)


def _out(shape, dtype, like):
  """Output shape that varies over the same mesh axes as `like` (inside shard_map)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def _params(st):
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                              vmem_limit_bytes=st.vmem_limit_bytes)


def _cost(q, k, v, st, passes):
  batch, heads, q_len, head_dim = q.shape
  flops = passes * 2 * batch * heads * q_len * k.shape[2] * head_dim
  if st.causal:
    flops //= 2
  nbytes = sum(x.size * x.dtype.itemsize for x in (q, k, v)) * 2
  return pl.CostEstimate(flops=flops, transcendentals=flops // (2 * head_dim),
                         bytes_accessed=nbytes)


def _col_spec(block, index):
  """Segment ids as a column ([block, 128] tile, ids on sublanes)."""
  return pl.BlockSpec((None, block, _LANES), lambda *g: (g[0], index(*g), 0))


def _row_spec(block, index):
  """Segment ids as a row ([8, block] tile, ids on lanes)."""
  return pl.BlockSpec((None, _SUBLANES, block), lambda *g: (g[0], 0, index(*g)))


def _seg_layouts(seg, column):
  """[B, L] ids -> [B, L, 128] (column tiles) or [B, 8, L] (row tiles)."""
  if seg is None:
    return None
  if column:
    return jnp.broadcast_to(seg[:, :, None], seg.shape + (_LANES,))
  return jnp.broadcast_to(seg[:, None, :], (seg.shape[0], _SUBLANES, seg.shape[1]))


def _forward(q, k, v, q_seg, kv_seg, st):
  batch, num_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  bq, bk = st.block_q, st.block_k

  def kv_index(b, h, i, j):
    first, last = _kv_range(st, i, bq, bk)
    return (b, h, jnp.clip(j, first, last), 0)  # skipped tiles re-use the last DMA

  q_spec = pl.BlockSpec((None, group, bq, head_dim), lambda b, h, i, j: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, bk, head_dim), kv_index)
  seg_specs = [None, None]
  if q_seg is not None:
    seg_specs = [_col_spec(bq, lambda b, h, i, j: i),
                 _row_spec(bk, lambda b, h, i, j: kv_index(b, h, i, j)[2])]
  lse_spec = pl.BlockSpec((None, group, bq, _LANES), lambda b, h, i, j: (b, h, i, 0))
  o, lse = pl.pallas_call(
      functools.partial(_fwd_kernel, st=st, group=group),
      grid=(batch, num_kv_heads, q_len // bq, kv_len // bk),
      in_specs=[q_spec, kv_spec, kv_spec, *seg_specs],
      out_specs=[q_spec, lse_spec],
      out_shape=[_out(q.shape, q.dtype, q), _out((batch, num_heads, q_len, _LANES), jnp.float32, q)],
      scratch_shapes=[pltpu.VMEM((group, bq, _LANES), jnp.float32),
                      pltpu.VMEM((group, bq, _LANES), jnp.float32),
                      pltpu.VMEM((group, bq, head_dim), jnp.float32)],
      compiler_params=_params(st),
      cost_estimate=_cost(q, k, v, st, passes=2),
      interpret=st.interpret,
      name="flash_attention_fwd",
  )(q, k, v, _seg_layouts(q_seg, True), _seg_layouts(kv_seg, False))
  return o, lse[..., 0]


def _backward(q, k, v, q_seg, kv_seg, o, lse, do, st):
  batch, num_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  bq, bk = st.block_q_bwd, st.block_k_bwd
  num_q_blocks, num_k_blocks = q_len // bq, kv_len // bk
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
  # Per-row statistics as lane-major rows: they broadcast over a transposed tile.
  lse, delta = lse[:, :, None, :], delta[:, :, None, :]
  q_segs = _seg_layouts(q_seg, False)
  kv_segs = _seg_layouts(kv_seg, True)

  # dK, dV: kv tile fixed, sweep the query tiles that can see it.
  def q_index(b, h, j, i):
    first, last = _q_range(st, j, bq, bk, num_q_blocks)
    return jnp.clip(i, first, last)

  qo_spec = pl.BlockSpec((None, group, bq, head_dim), lambda b, h, j, i: (b, h, q_index(b, h, j, i), 0))
  row_spec = pl.BlockSpec((None, group, 1, bq), lambda b, h, j, i: (b, h, 0, q_index(b, h, j, i)))
  kv_spec = pl.BlockSpec((None, None, bk, head_dim), lambda b, h, j, i: (b, h, j, 0))
  seg_specs = [None, None]
  if q_seg is not None:
    seg_specs = [_row_spec(bq, lambda b, h, j, i: q_index(b, h, j, i)),
                 _col_spec(bk, lambda b, h, j, i: j)]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, st=st, group=group),
      grid=(batch, num_kv_heads, num_k_blocks, num_q_blocks),
      in_specs=[qo_spec, kv_spec, kv_spec, qo_spec, row_spec, row_spec, *seg_specs],
      out_specs=[kv_spec, kv_spec],
      out_shape=[_out(k.shape, k.dtype, k), _out(v.shape, v.dtype, v)],
      scratch_shapes=[pltpu.VMEM((bk, head_dim), jnp.float32),
                      pltpu.VMEM((bk, head_dim), jnp.float32)],
      compiler_params=_params(st),
      cost_estimate=_cost(q, k, v, st, passes=4),
      interpret=st.interpret,
      name="flash_attention_dkv",
  )(q, k, v, do, lse, delta, q_segs, kv_segs)

  # dQ: query tile fixed, sweep the kv tiles it can see.
  def kv_index(b, h, i, j):
    first, last = _kv_range(st, i, bq, bk)
    return jnp.clip(j, first, last)

  qo_spec = pl.BlockSpec((None, group, bq, head_dim), lambda b, h, i, j: (b, h, i, 0))
  row_spec = pl.BlockSpec((None, group, 1, bq), lambda b, h, i, j: (b, h, 0, i))
  kv_spec = pl.BlockSpec((None, None, bk, head_dim), lambda b, h, i, j: (b, h, kv_index(b, h, i, j), 0))
  seg_specs = [None, None]
  if q_seg is not None:
    seg_specs = [_row_spec(bq, lambda b, h, i, j: i),
                 _col_spec(bk, lambda b, h, i, j: kv_index(b, h, i, j))]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st, group=group),
      grid=(batch, num_kv_heads, num_q_blocks, num_k_blocks),
      in_specs=[qo_spec, kv_spec, kv_spec, qo_spec, row_spec, row_spec, *seg_specs],
      out_specs=qo_spec,
      out_shape=_out(q.shape, q.dtype, q),
      scratch_shapes=[pltpu.VMEM((group, bq, head_dim), jnp.float32)],
      compiler_params=_params(st),
      cost_estimate=_cost(q, k, v, st, passes=3),
      interpret=st.interpret,
      name="flash_attention_dq",
  )(q, k, v, do, lse, delta, q_segs, kv_segs)
  return dq, dk, dv


# Kernels take `st` last; the shared VJP passes it first.
_flash = with_lse_vjp(lambda st, *args: _forward(*args, st), lambda st, *args: _backward(*args, st))


def flash_attention_tpu(q, k, v, *, segment_ids=None, causal=True, sliding_window=None,
                        logit_soft_cap=None, scale=None, block_sizes=None, interpret=False):
  """q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] -> [B, Lq, Hq, D] (Mosaic TPU kernel).

  Sequences that are not a multiple of the tile are zero-padded; padded keys are
  masked and padded queries are dropped, so their gradients vanish.
  """
  validation.check_attention_args(q, k, v, segment_ids, sliding_window, logit_soft_cap)
  blocks = block_sizes or default_block_sizes("tpu", _device_kind())
  q_len, kv_len = q.shape[1], k.shape[1]
  tiles = tiling.fit_tiles(blocks, q_len, kv_len, _LANES)
  q_pad = tiling.round_up(q_len, math.lcm(tiles["block_q"], tiles["block_q_bwd"]))
  kv_pad = tiling.round_up(kv_len, math.lcm(tiles["block_k"], tiles["block_k_bwd"]))
  st = _Static(causal=causal, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
               scale=q.shape[-1] ** -0.5 if scale is None else scale,
               q_offset=kv_len - q_len, kv_len=kv_len, vmem_limit_bytes=blocks.vmem_limit_bytes,
               interpret=interpret, **tiles)
  to_kernel = lambda x, n: tiling.pad_axis(x, 1, n).transpose(0, 2, 1, 3)
  q_seg, kv_seg = tiling.padded_segments(segment_ids, q_len, q_pad, kv_pad)
  o = _flash(st, to_kernel(q, q_pad), to_kernel(k, kv_pad), to_kernel(v, kv_pad), q_seg, kv_seg)
  return o.transpose(0, 2, 1, 3)[:, :q_len]


def _device_kind():
  device = jax.devices()[0]
  return device.device_kind if device.platform == "tpu" else ""
