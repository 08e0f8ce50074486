"""The gated delta rule over a sequence split across devices, LASP-2 style (Sun et al., 2025):
one all-gather of per-piece states whose size does not depend on the sequence length.

Per device, inside a `shard_map` that is manual over the mesh axes splitting the length.
Each device holds one contiguous piece of every row, or two in zig-zag order (pieces d and
2N-1-d of 2N). Over a piece the delta rule is affine in the state it starts from:
S_out = M S_in + B, M = prod_t (I - beta_t k_t k_t^T) exp(g_t) [key_dim, key_dim], so

1. each device finds M (the door run from S_in = I with zero values) and B (from S_in = 0)
   for its pieces;
2. one all-gather over the length axes gives every device every piece's (M, B) and the
   segment ids at its two ends: [pieces, B, value_heads, key_dim, key_dim + value_dim];
3. each device folds them in sequence order up to its own pieces (a packed segment that
   starts at a piece's first token starts from zeros) and runs the door once more from
   the state its piece starts with.

Three passes of the local work, one collective per layer of fixed size; softmax layers of a
hybrid keep their own context attention.
"""

import jax.numpy as jnp
from jax import lax

def _pieces(x, count: int):
  return None if x is None else jnp.split(x, count, axis=1)


def _layout(shards: int, zigzag: bool, axes: tuple):
  """(the (device, piece) at each sequence position, in pieces; this device's pieces'
  positions, traced): where every piece sits in the sequence."""
  order = [[d, 2 * shards - 1 - d] if zigzag else [d] for d in range(shards)]
  at = {order[d][p]: (d, p) for d in range(shards) for p in range(len(order[0]))}
  device = lax.axis_index(axes)
  mine = [jnp.asarray([order[d][p] for d in range(shards)])[device] for p in range(len(order[0]))]
  return [at[i] for i in range(len(at))], mine


def gated_delta_rule_split(rule, q, k, v, g, beta, segment_ids, *, axes: tuple, shards: int, zigzag: bool):
  """This device's pieces q, k [B, L/N, Hk, Dk], v [B, L/N, Hv, Dv], g, beta [B, L/N, Hv],
  segment_ids [B, L/N] or None -> out [B, L/N, Hv, Dv]. `rule(q, k, v, g, beta,
  initial_state, segment_ids) -> (out, final_state)` is the single-device door."""
  count = 2 if zigzag else 1
  batch, _, num_heads, value_dim = v.shape
  key_dim = k.shape[-1]
  pieces = list(zip(*(_pieces(x, count) for x in (q, k, v, g, beta))))
  segs = _pieces(segment_ids, count) or [None] * count
  eye = jnp.broadcast_to(jnp.eye(key_dim, dtype=jnp.float32), (batch, num_heads, key_dim, key_dim))
  moves, offsets, ends = [], [], []
  for (qp, kp, vp, gp, bp), sp in zip(pieces, segs):
    none = jnp.zeros((*vp.shape[:3], key_dim), vp.dtype)
    moves.append(rule(qp, kp, none, gp, bp, eye, sp)[1])
    offsets.append(rule(qp, kp, vp, gp, bp, None, sp)[1])
    if sp is not None:
      ends.append(jnp.stack([sp[:, 0], sp[:, -1]], axis=-1))  # [B, 2]: the piece's first and last ids
  gather = lambda x: lax.all_gather(jnp.stack(x), axes, axis=0, tiled=False)  # noqa: E731  [N, count, ...]
  all_moves, all_offsets = gather(moves), gather(offsets)
  all_ends = gather(ends) if ends else None
  at, mine = _layout(shards, zigzag, axes)
  starts = [jnp.zeros((batch, num_heads, key_dim, value_dim), jnp.float32)]
  for position in range(1, shards * count):
    d, p = at[position - 1]
    carried = jnp.einsum("bhij,bhjv->bhiv", all_moves[d, p], starts[-1]) + all_offsets[d, p]
    if all_ends is not None:
      here = all_ends[at[position][0], at[position][1], :, 0]
      carried = jnp.where((here == all_ends[d, p, :, 1])[:, None, None, None], carried, 0.0)
    starts.append(carried)
  starts = jnp.stack(starts)  # [positions, B, Hv, Dk, Dv]
  outs = [rule(qp, kp, vp, gp, bp, starts[mine[p]], sp)[0]
          for p, ((qp, kp, vp, gp, bp), sp) in enumerate(zip(pieces, segs))]
  return jnp.concatenate(outs, axis=1)


def from_predecessor(values: list, fill, *, axes: tuple, shards: int, zigzag: bool) -> list:
  """For each of this device's pieces, `values`' entry of the piece before it in sequence
  order (one all-gather of them all); `fill` for the sequence's first piece. What a short
  convolution needs across a piece boundary."""
  count = len(values)
  gathered = lax.all_gather(jnp.stack(values), axes, axis=0, tiled=False)  # [N, count, ...]
  at, mine = _layout(shards, zigzag, axes)
  table = jnp.stack([fill] + [gathered[at[i]] for i in range(shards * count - 1)])  # by position
  return [table[position] for position in mine]
