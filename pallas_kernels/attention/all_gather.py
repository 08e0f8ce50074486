"""All-gather context parallelism, per device inside `shard_map`.

Queries stay split over the devices; keys and values (and the keys' segment ids) are
all-gathered, put back in sequence order, and each of the device's query pieces (two in
zig-zag order, one at a time) attends to all of them with the blockwise kernel at its own
offset, whose causal tile skipping keeps the work to the keys it can see (and its sinks,
since each piece meets every key in one call). Cheap when there are few kv heads (GQA): the
gathered K/V are Hkv/Hq of what the queries would be.

The backward gathers K/V again rather than keeping the gathered copy alive between the
passes (memory per device stays O(L / N) between layers), and reduce-scatters dK/dV
(in float32) back to their owners.
"""

import jax.numpy as jnp
from jax import lax

from jaxpar.pallas_kernels.attention import layout
from jaxpar.pallas_kernels.attention.blockwise import full_like_varying
from jaxpar.pallas_kernels.attention.layout import piece
from jaxpar.pallas_kernels.attention.lse_vjp import with_lse_vjp


def _gather(split, x):
  """This device's [B, L/N, ...] -> the whole [B, L, ...] in sequence order."""
  if x is None:
    return None
  whole = lax.all_gather(x, split.axes, axis=1, tiled=True)
  return layout.unzigzag(whole, split.shards) if split.zigzag else whole


def _scatter_sum(split, x):
  """Per-device contributions to the whole [B, L, ...] -> this device's summed share."""
  if split.zigzag:
    x = layout.zigzag(x, split.shards)
  return lax.psum_scatter(x, split.axes, scatter_dimension=1, tiled=True)


def _forward(st, q, k, v, sinks, q_seg, kv_seg):
  split, kernel, spec = st
  k_all, v_all, kv_seg_all = _gather(split, k), _gather(split, v), _gather(split, kv_seg)
  qs, q_segs = split.split(q), split.split(q_seg)
  starts = split.starts(lax.axis_index(split.axes), qs.shape[2])

  def one(a, out):  # one query piece at a time: one kernel in the program
    o, lse = kernel.forward(spec, qs[a], k_all, v_all, sinks, piece(q_segs, a), kv_seg_all, starts[a])
    return out[0].at[a].set(o), out[1].at[a].set(lse)

  batch, n, heads, _ = qs.shape[1:]
  out = (full_like_varying((*qs.shape[:-1], v.shape[-1]), 0.0, q, q.dtype),  # values' head dim
         full_like_varying((split.pieces, batch, heads, n), 0.0, q))
  o, lse = lax.fori_loop(0, split.pieces, one, out)
  return split.join(o), jnp.concatenate(list(lse), axis=-1)


def _backward(st, q, k, v, q_seg, kv_seg, o, lse, do):
  split, kernel, spec = st
  k_all, v_all, kv_seg_all = _gather(split, k), _gather(split, v), _gather(split, kv_seg)
  qs, q_segs, os, dos = (split.split(x) for x in (q, q_seg, o, do))
  lses = jnp.stack(jnp.split(lse, split.pieces, axis=-1))
  starts = split.starts(lax.axis_index(split.axes), qs.shape[2])

  def one(a, carry):
    dq, dk, dv = carry
    dq_a, dk_a, dv_a = kernel.backward(spec, qs[a], k_all, v_all, piece(q_segs, a), kv_seg_all,
                                       starts[a], os[a], lses[a], dos[a])
    return dq.at[a].set(dq_a), dk + dk_a, dv + dv_a

  init = (full_like_varying(qs.shape, 0.0, q, q.dtype), full_like_varying(k_all.shape, 0.0, q),
          full_like_varying(v_all.shape, 0.0, q))
  dq, dk, dv = lax.fori_loop(0, split.pieces, one, init)
  return (split.join(dq), _scatter_sum(split, dk).astype(k.dtype),
          _scatter_sum(split, dv).astype(v.dtype))


# all_gather_attention(st, q, k, v, sinks, q_seg, kv_seg) -> o,
# st = (SequenceSplit, Blockwise, AttentionSpec).
all_gather_attention = with_lse_vjp(_forward, _backward)
