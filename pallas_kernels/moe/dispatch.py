"""The entry point MoE layers call: routed tokens through their experts, on any mesh.

Each device routes its own tokens (no global sort), inside `jax.shard_map` through the
logical helper. With the `experts` weights split over mesh axes (expert parallelism,
EP = n), every device sends each token-assignment to the device holding its expert with
one all-to-all, runs its local experts on what it received, and a second all-to-all
brings the results home. XLA:CPU has no ragged all-to-all, so the exchange is a dense
all-to-all of a bounded buffer: `buffer` rows per destination, fixed at trace time, so an
uneven load never recompiles. Assignments past the buffer are dropped and reported
exactly (`kept` is False for them); by default the buffer holds all of a device's
assignments (T x k), so nothing is ever dropped. The local expert compute only touches
the rows that arrived (grouped.py skips empty blocks), whatever the buffer size.

Expert FFN dimensions split over the `mlp` axes (tensor parallelism inside each expert)
are summed at the end; experts' `embed` dimension arrives whole (FSDP gathers it at the
shard_map boundary, as for dense layers).
"""

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.mesh import logical_shard_map, mesh_axes
from jaxpar.pallas_kernels.moe.grouped import block_rows, grouped_ffn

_TOKENS = ("batch", "length", None)
_IN = ("experts", None, "mlp")  # gate, up [E, D, F]
_OUT = ("experts", "mlp", None)  # down [E, F, D]


def rank_within(keys, num_keys: int):
  """For int keys [N] in [0, num_keys): each element's rank among the elements with the same
  key, in index order (0 for the first)."""
  order = jnp.argsort(keys, stable=True)
  counts = jnp.zeros((num_keys,), jnp.int32).at[keys].add(1)
  starts = jnp.cumsum(counts) - counts
  sorted_keys = keys[order]
  return jnp.zeros_like(keys).at[order].set(jnp.arange(keys.shape[0], dtype=keys.dtype) - starts[sorted_keys])


def _local_experts(rows, local_ids, gate, up, down, implementation, block):
  """rows [R, D] with local expert ids [R] (== number of local experts: an empty slot)."""
  num_local = gate.shape[0]
  order = jnp.argsort(local_ids, stable=True)
  sizes = jnp.zeros((num_local,), jnp.int32).at[local_ids].add(1, mode="drop")
  out = grouped_ffn(rows[order], sizes, gate, up, down, implementation=implementation, block=block)
  return jnp.zeros_like(out).at[order].set(out)


def _per_device(x, expert_ids, weights, gate, up, down, *, ep, ep_size, tp, replicated,
                capacity_factor, ep_buffer_factor, implementation):
  # Weights are the same on devices with different tokens (`replicated` axes) and tokens the
  # same on devices with different expert slices (`tp`). Mark both as varying over those
  # axes here, so the gradients' sums over them happen once, at this level, and not inside
  # grouped.py's per-block conditional, which devices take differently (a collective there
  # deadlocks).
  if replicated:
    gate, up, down = (jax.lax.pcast(w, replicated, to="varying") for w in (gate, up, down))
  if tp:
    x = jax.lax.pcast(x, tp, to="varying")
  b, length, dim = x.shape
  k = expert_ids.shape[-1]
  tokens, assignments = b * length, b * length * k
  num_local = gate.shape[0]
  num_experts = num_local * ep_size
  x = x.reshape(tokens, dim)
  ids = expert_ids.reshape(assignments).astype(jnp.int32)
  kept = jnp.ones((assignments,), bool)
  if capacity_factor is not None:
    # Per expert, the first `capacity` assignments of this device's tokens (token order).
    capacity = max(1, math.ceil(capacity_factor * assignments / num_experts))
    kept = rank_within(ids, num_experts) < capacity
    buffer = min(assignments, num_local * capacity)  # a destination can never overflow
  elif ep_buffer_factor is None:
    buffer = assignments
  else:
    buffer = min(assignments, max(1, math.ceil(ep_buffer_factor * assignments / ep_size)))
  # Slot of each kept assignment in its destination's buffer; ep_size: dropped.
  dest = jnp.where(kept, ids // num_local, ep_size)
  slot = rank_within(dest, ep_size + 1)
  kept = kept & (slot < buffer)
  index = jnp.where(kept, dest * buffer + slot, ep_size * buffer)
  token = jnp.arange(assignments) // k
  send_x = jnp.zeros((ep_size * buffer, dim), x.dtype).at[index].set(x[token], mode="drop")
  send_ids = jnp.full((ep_size * buffer,), num_local, jnp.int32).at[index].set(ids % num_local,
                                                                               mode="drop")
  exchange = functools.partial(jax.lax.all_to_all, axis_name=ep, split_axis=0, concat_axis=0,
                               tiled=True)
  if ep:
    send_x, send_ids = exchange(send_x), exchange(send_ids)
  # Each device's assignments, balanced: what one device's experts receive on average.
  out = _local_experts(send_x, send_ids, gate, up, down, implementation,
                       block_rows(assignments, num_local))
  if ep:
    out = exchange(out)
  mine = jnp.take(out, index, axis=0, mode="fill", fill_value=0).reshape(tokens, k, dim)
  y = jnp.einsum("tk,tkd->td", weights.reshape(tokens, k).astype(jnp.float32),
                 mine.astype(jnp.float32)).astype(x.dtype)
  if tp:
    y = jax.lax.psum(y, tp)
  return y.reshape(b, length, dim), kept.reshape(b, length, k)


def routed_experts(x, expert_ids, weights, gate, up, down, *, capacity_factor=None,
                   ep_buffer_factor=None, implementation="auto"):
  """x [B, L, D]; expert_ids int [B, L, k]; weights [B, L, k]; gate, up [E, D, F];
  down [E, F, D] -> (y [B, L, D], kept bool [B, L, k]).

  y = sum over kept assignments j of weights[..., j] * expert_{expert_ids[..., j]}(x).
  capacity_factor: None (dropless) or each expert takes at most
    ceil(factor x T x k / E) of a device's T tokens' assignments, in token order.
  ep_buffer_factor: with expert parallelism n and no capacity, rows each device reserves
    per destination as a multiple of its balanced share T x k / n (None: T x k, never full).
  """
  num_experts, ffn = gate.shape[0], gate.shape[-1]
  ep, tp = mesh_axes("experts", num_experts), mesh_axes("mlp", ffn)
  replicated = tuple(a for a in mesh_axes("batch", x.shape[0]) if a not in ep + tp)
  mesh = jax.sharding.get_abstract_mesh()
  ep_size = math.prod(mesh.shape[a] for a in ep)
  fn = functools.partial(_per_device, ep=ep, ep_size=ep_size, tp=tp, replicated=replicated,
                         capacity_factor=capacity_factor, ep_buffer_factor=ep_buffer_factor,
                         implementation=implementation)
  return logical_shard_map(fn, (_TOKENS, _TOKENS, _TOKENS, _IN, _IN, _OUT),
                           [_TOKENS, _TOKENS])(x, expert_ids, weights, gate, up, down)
