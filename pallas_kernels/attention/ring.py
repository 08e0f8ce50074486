"""Ring attention (Liu et al., 2023), per device inside `shard_map`.

Each device keeps its queries and passes its key/value block (with the keys' segment ids)
to the next device on the ring, N - 1 times, so after N steps every query has met every
key while no device ever holds more than two blocks. Each step runs the blockwise
kernel (flash on TPU/GPU, the chunked path elsewhere) on the block in hand and merges its
output into a running result through the blocks' log-sum-exps (an online softmax over
blocks). The transfer of the next block is issued before the current block's compute,
so XLA can overlap them.

The backward runs the ring again: each step's kernel backward takes the final output and
log-sum-exp (so it yields exactly that block's share of the gradient); dQ accumulates in
place, while dK/dV accumulate in buffers that travel with their block and arrive home
after the N-th transfer. Gradient buffers travel in float32.

Pieces: under zig-zag order a device's tokens are two chunks at different places in the
sequence, so each step pairs every query piece with every key piece, one pair at a time
(a loop: one kernel in the program, one tile in flight), each with the pair's relative
offset. The kernels skip pairs the causal mask hides, so work stays balanced.

Attention sinks join once, after the last block: one more partial with no keys.
"""

import jax.numpy as jnp
from jax import lax

from jaxpar.pallas_kernels.attention.blockwise import add_sinks, full_like_varying, merge_partials
from jaxpar.pallas_kernels.attention.layout import piece
from jaxpar.pallas_kernels.attention.lse_vjp import with_lse_vjp


def _ring(split):
  """ppermute pairs: every device sends to the next one on the ring."""
  return [(i, (i + 1) % split.shards) for i in range(split.shards)]


def _pairs(split):
  """Loop bounds and (query piece, key piece) of loop index i."""
  count = split.pieces
  return count * count, lambda i: (i // count, i % count)


def _forward(st, q, k, v, sinks, q_seg, kv_seg):
  split, kernel, spec = st
  index = lax.axis_index(split.axes)
  qs, q_segs = split.split(q), split.split(q_seg)
  n = qs.shape[2]
  q_starts = split.starts(index, n)
  num_pairs, pair = _pairs(split)

  def attend(acc, kv, source):
    ks, vs, k_segs = (split.split(x) for x in kv)
    k_starts = split.starts(source, n)

    def one(i, acc):
      a, b = pair(i)
      block = kernel.forward(spec, qs[a], ks[b], vs[b], None, piece(q_segs, a), piece(k_segs, b),
                             q_starts[a] - k_starts[b])
      o, lse = merge_partials((acc[0][a], acc[1][a]), block)
      return acc[0].at[a].set(o), acc[1].at[a].set(lse)

    return lax.fori_loop(0, num_pairs, one, acc)

  def step(carry, s):
    acc, kv = carry
    incoming = lax.ppermute(kv, split.axes, _ring(split))  # overlaps this step's compute
    return (attend(acc, kv, (index - s) % split.shards), incoming), None

  batch, _, heads, _ = q.shape
  empty = (full_like_varying((split.pieces, batch, n, heads, v.shape[-1]), 0.0, q),  # values' head dim
           full_like_varying((split.pieces, batch, heads, n), -jnp.inf, q))
  (acc, kv), _ = lax.scan(step, (empty, (k, v, kv_seg)), jnp.arange(split.shards - 1))
  o, lse = attend(acc, kv, (index + 1) % split.shards)  # the last block needs no onward send
  o, lse = add_sinks(split.join(o), jnp.concatenate(list(lse), axis=-1), sinks)
  return o.astype(q.dtype), lse


def _backward(st, q, k, v, q_seg, kv_seg, o, lse, do):
  split, kernel, spec = st
  index = lax.axis_index(split.axes)
  qs, q_segs, os, dos = (split.split(x) for x in (q, q_seg, o, do))
  n = qs.shape[2]
  lses = jnp.stack(jnp.split(lse, split.pieces, axis=-1))  # [pieces, B, H, n]
  q_starts = split.starts(index, n)
  num_pairs, pair = _pairs(split)

  def grads(dq, kv, dkv, source):
    ks, vs, k_segs = (split.split(x) for x in kv)
    k_starts = split.starts(source, n)

    def one(i, carry):
      dq, dk, dv = carry
      a, b = pair(i)
      dq_i, dk_j, dv_j = kernel.backward(spec, qs[a], ks[b], vs[b], piece(q_segs, a), piece(k_segs, b),
                                         q_starts[a] - k_starts[b], os[a], lses[a], dos[a])
      return dq.at[a].add(dq_i), dk.at[b].add(dk_j), dv.at[b].add(dv_j)

    dq, dk, dv = lax.fori_loop(0, num_pairs, one, (dq, *dkv))
    # The block's gradient buffers move on with it (the N-th move brings them home).
    return dq, lax.ppermute((dk, dv), split.axes, _ring(split))

  def step(carry, s):
    dq, kv, dkv = carry
    incoming = lax.ppermute(kv, split.axes, _ring(split))
    dq, dkv = grads(dq, kv, dkv, (index - s) % split.shards)
    return (dq, incoming, dkv), None

  zeros = lambda x: full_like_varying(split.split(x).shape, 0.0, q)
  init = (zeros(q), (k, v, kv_seg), (zeros(k), zeros(v)))
  (dq, kv, dkv), _ = lax.scan(step, init, jnp.arange(split.shards - 1))
  dq, (dk, dv) = grads(dq, kv, dkv, (index + 1) % split.shards)
  return (split.join(dq).astype(q.dtype), split.join(dk).astype(k.dtype),
          split.join(dv).astype(v.dtype))


# ring_attention(st, q, k, v, sinks, q_seg, kv_seg) -> o, st = (SequenceSplit, Blockwise, AttentionSpec).
ring_attention = with_lse_vjp(_forward, _backward)
