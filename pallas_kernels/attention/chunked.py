"""Memory-efficient attention in plain XLA: FlashAttention-2's algorithm with loops.

The CPU path (and the fallback for shapes the kernels do not take). Forward: for each
query block, an online softmax over the key blocks it can see. Backward (custom VJP):
recompute probabilities from the saved log-sum-exp, one key block at a time, so no
[Lq, Lk] buffer exists in either direction: memory is O(L * D + block_q * block_k).
Key blocks that are fully masked (causal, window) are skipped by the loop bounds.
"""


import jax.numpy as jnp
from jax import lax

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.attention import masking, validation
from jaxpar.pallas_kernels.attention.block_sizes import default_block_sizes
from jaxpar.pallas_kernels.attention.blockwise import (Blockwise, Tiled, default_offset, full_like_varying,
                                                       split_segments)
from jaxpar.pallas_kernels.attention.lse_vjp import with_lse_vjp
from jaxpar.pallas_kernels.attention.spec import AttentionSpec


def _blocks(x, block):
  """[B, L, ...] -> [L // block, B, block, ...]."""
  x = x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _unblock(x):
  """[n, B, block, ...] -> [B, n * block, ...]."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _logits(st, q, k, i, j, q_seg, k_seg, q_offset):
  """Capped logits [B, Hkv, G, bq, bk] of q block i vs k block j, and the mask."""
  raw = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * st.scale
  capped = masking.soft_cap(raw, st.logit_soft_cap)
  q_pos = q_offset + i * st.block_q + jnp.arange(st.block_q)[:, None]
  k_pos = j * st.block_k + jnp.arange(st.block_k)[None, :]
  segs = {}
  if q_seg is not None:
    segs = dict(q_seg=q_seg[:, None, None, :, None], k_seg=k_seg[:, None, None, None, :])
  mask = masking.token_mask(q_pos, k_pos, st.mask, kv_len=st.kv_len, **segs)
  return capped, mask


def _kv_range(st, i, q_offset):
  q_lo = q_offset + i * st.block_q
  return masking.kv_block_range(q_lo, q_lo + st.block_q - 1, st.block_k, st.mask, kv_len=st.kv_len)


def _forward(st, q, k, v, sinks, q_seg, kv_seg, q_offset):
  """q: [nq, B, bq, Hkv, G, D]; k: [nk, B, bk, Hkv, D]; v: [.., Dv]; sinks [Hq] or None
  -> o [nq, B, bq, Hkv, G, Dv], lse [nq, B, Hkv, G, bq]."""
  batch, bq, num_kv_heads, group = q.shape[1:5]
  value_dim = v.shape[-1]

  def q_block(args):
    i, qi, qsi = args
    first, last = _kv_range(st, i, q_offset)

    def step(j, carry):
      m, l, acc = carry
      s, mask = _logits(st, qi, k[j], i, j, qsi, None if kv_seg is None else kv_seg[j], q_offset)
      s = jnp.where(mask, s, masking.MASK_VALUE)
      m_next = jnp.maximum(m, s.max(axis=-1))
      p = jnp.exp(s - m_next[..., None])
      alpha = jnp.exp(m - m_next)
      pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v[j],
                      preferred_element_type=jnp.float32)
      return m_next, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

    stats = (batch, num_kv_heads, group, bq)
    m, l = full_like_varying(stats, masking.MASK_VALUE, qi), full_like_varying(stats, 0.0, qi)
    if sinks is not None:  # the sink is a first key of value 0: max = sink, sum = 1
      m = full_like_varying(stats, 0.0, qi) + sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)
      l = l + 1.0
    init = (m, l, full_like_varying(stats + (value_dim,), 0.0, qi))
    m, l, acc = lax.fori_loop(first, last + 1, step, init)
    l = jnp.where(l == 0.0, 1.0, l)  # rows that saw only padding stay finite
    o = jnp.einsum("bhgqd->bqhgd", acc / l[..., None]).astype(qi.dtype)
    return o, m + jnp.log(l)

  return lax.map(q_block, (jnp.arange(q.shape[0]), q, q_seg))


def _backward(st, q, k, v, q_seg, kv_seg, q_offset, o, lse, do):
  num_q_blocks = q.shape[0]
  delta = jnp.einsum("nbqhgd,nbqhgd->nbhgq", o.astype(jnp.float32), do.astype(jnp.float32))

  def kv_block(j, carry):
    dq, dk, dv = carry
    kj, vj = k[j], v[j]
    k_lo = j * st.block_k
    first, last = masking.q_block_range(k_lo, k_lo + st.block_k - 1, st.block_q, num_q_blocks, st.mask,
                                        q_offset=q_offset)

    def q_step(i, inner):
      dq, dkj, dvj = inner
      s, mask = _logits(st, q[i], kj, i, j, None if q_seg is None else q_seg[i],
                        None if kv_seg is None else kv_seg[j], q_offset)
      p = jnp.exp(jnp.where(mask, s, masking.MASK_VALUE) - lse[i][..., None])
      dvj += jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do.dtype), do[i],
                        preferred_element_type=jnp.float32)
      dp = jnp.einsum("bqhgd,bkhd->bhgqk", do[i], vj, preferred_element_type=jnp.float32)
      ds = p * (dp - delta[i][..., None]) * masking.soft_cap_grad(s, st.logit_soft_cap)
      ds = ds.astype(q.dtype)
      dkj += jnp.einsum("bhgqk,bqhgd->bkhd", ds, q[i], preferred_element_type=jnp.float32)
      dqi = jnp.einsum("bhgqk,bkhd->bqhgd", ds, kj, preferred_element_type=jnp.float32)
      return dq.at[i].add(dqi), dkj, dvj

    zeros = lambda like: full_like_varying(like.shape, 0.0, q)  # noqa: E731
    dq, dkj, dvj = lax.fori_loop(first, last + 1, q_step, (dq, zeros(kj), zeros(vj)))
    return dq, dk.at[j].set(dkj), dv.at[j].set(dvj)

  init = tuple(full_like_varying(x.shape, 0.0, q) for x in (q, k, v))
  dq, dk, dv = lax.fori_loop(0, k.shape[0], kv_block, init)
  return ((dq * st.scale).astype(q.dtype), (dk * st.scale).astype(k.dtype), dv.astype(v.dtype))


def _static(spec, q, k):
  """The loops' statics: one tile pair for both passes, each at most its sequence."""
  blocks = spec.block_sizes or default_block_sizes("cpu")
  tiling.check_block("block_q", blocks.block_q, 1)
  tiling.check_block("block_k", blocks.block_k, 1)
  block_q, block_k = min(blocks.block_q, q.shape[1]), min(blocks.block_k, k.shape[1])
  return Tiled(spec, k.shape[1], spec.scale_for(q.shape[-1]), block_q, block_k, block_q, block_k)


def _q_blocks(st, x, num_kv_heads):
  """[B, Lq, Hq, D] -> [nq, B, bq, Hkv, G, D] (zero-padded to whole blocks)."""
  batch, q_len, num_heads, head_dim = x.shape
  q_pad = tiling.round_up(q_len, st.block_q)
  x = tiling.pad_axis(x, 1, q_pad).reshape(batch, q_pad, num_kv_heads, num_heads // num_kv_heads, head_dim)
  return _blocks(x, st.block_q)


def _kv_blocks(st, x):
  return _blocks(tiling.pad_axis(x, 1, tiling.round_up(st.kv_len, st.block_k)), st.block_k)


def _seg_blocks(st, q_seg, kv_seg, q_len):
  q_seg, kv_seg = tiling.padded_segments(q_seg, kv_seg, tiling.round_up(q_len, st.block_q),
                                         tiling.round_up(st.kv_len, st.block_k))
  if q_seg is None:
    return None, None
  return _blocks(q_seg, st.block_q), _blocks(kv_seg, st.block_k)


def _q_unblock(x, q_len):
  """[nq, B, bq, Hkv, G, D] -> [B, Lq, Hq, D]."""
  x = _unblock(x)
  return x.reshape(*x.shape[:2], -1, x.shape[-1])[:, :q_len]


def forward(spec, q, k, v, sinks, q_seg, kv_seg, q_offset):
  """The blockwise forward (see blockwise.py): (o [B, Lq, Hq, D], lse [B, Hq, Lq])."""
  st = _static(spec, q, k)
  q_len = q.shape[1]
  o, lse = _forward(st, _q_blocks(st, q, k.shape[2]), _kv_blocks(st, k), _kv_blocks(st, v), sinks,
                    *_seg_blocks(st, q_seg, kv_seg, q_len), q_offset)
  lse = jnp.moveaxis(lse, 0, 3)  # [B, Hkv, G, nq, bq]
  return _q_unblock(o, q_len), lse.reshape(lse.shape[0], -1, lse.shape[3] * lse.shape[4])[..., :q_len]


def backward(spec, q, k, v, q_seg, kv_seg, q_offset, o, lse, do):
  """The blockwise backward from a given log-sum-exp (see blockwise.py): (dq, dk, dv)."""
  st = _static(spec, q, k)
  q_len, bq, kv_heads = q.shape[1], st.block_q, k.shape[2]
  lse = tiling.pad_axis(lse, 2, tiling.round_up(q_len, bq))
  lse = lse.reshape(lse.shape[0], kv_heads, -1, lse.shape[2] // bq, bq)
  dq, dk, dv = _backward(st, _q_blocks(st, q, kv_heads), _kv_blocks(st, k), _kv_blocks(st, v),
                         *_seg_blocks(st, q_seg, kv_seg, q_len), q_offset, _q_blocks(st, o, kv_heads),
                         jnp.moveaxis(lse, 3, 0), _q_blocks(st, do, kv_heads))
  kv_len = k.shape[1]
  return _q_unblock(dq, q_len), _unblock(dk)[:, :kv_len], _unblock(dv)[:, :kv_len]


BLOCKWISE = Blockwise(forward, backward)
_chunked = with_lse_vjp(forward, backward)


def chunked_attention(q, k, v, spec: AttentionSpec = AttentionSpec(), *, segment_ids=None, sinks=None):
  """q: [B, Lq, Hq, D]; k: [B, Lk, Hkv, D]; v: [B, Lk, Hkv, Dv]; sinks [Hq] or None
  -> [B, Lq, Hq, Dv], without an Lq x Lk buffer."""
  validation.check_attention_args(q, k, v, segment_ids, head_dims=None, sinks=sinks)
  return _chunked(spec, q, k, v, sinks, *split_segments(segment_ids, q.shape[1]), default_offset(q, k))
