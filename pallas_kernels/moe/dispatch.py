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
the rows that arrived (grouped.py skips empty blocks), whatever the buffer size. A device
holding every expert with a handful of tokens (decode) runs every expert on each token
instead, when that is no more work than the padded blocks (`grouped.every_expert_is_cheaper`).

Expert weights arrive as they are stored: split over `experts` (EP), `embed` (FSDP: gathered
here, so their gradients leave reduce-scattered) and `mlp` (tensor parallelism inside each
expert: partial outputs summed at the end).
"""

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.mesh import logical_shard_map, mesh_axes
from jaxpar.pallas_kernels.moe.grouped import block_rows, every_expert_is_cheaper, grouped_ffn
from jaxpar.pallas_kernels.moe.reference import routed_experts_reference, silu_glu
from jaxpar.pallas_kernels.moe.rows import inverse, rank_within, take_rows

_TOKENS = ("batch", "length", None)
_IN = ("experts", "embed", "mlp")  # gate, up [E, D, F]
_OUT = ("experts", "mlp", "embed")  # down [E, F, D]
_BIAS = ("experts", "mlp")  # gate and up biases [E, F]


def _send_plan(ids, num_local: int, ep_size: int, capacity_factor, ep_buffer_factor):
  """Where each assignment goes -> (kept bool [A], index int [A] into the send buffer of
  ep_size x buffer rows, ordered by destination (ep_size x buffer: dropped), buffer)."""
  assignments = ids.shape[0]
  kept = jnp.ones((assignments,), bool)
  if capacity_factor is not None:
    # Per expert, the first `capacity` of this device's assignments.
    capacity = max(1, math.ceil(capacity_factor * assignments / (num_local * ep_size)))
    kept = rank_within(ids, num_local * ep_size) < capacity
    buffer = min(assignments, num_local * capacity)  # a destination can never overflow
  elif ep_buffer_factor is None:
    buffer = assignments
  else:
    buffer = min(assignments, max(1, math.ceil(ep_buffer_factor * assignments / ep_size)))
  dest = jnp.where(kept, ids // num_local, ep_size)  # ep_size: dropped already
  slot = rank_within(dest, ep_size + 1)
  kept = kept & (slot < buffer)
  return kept, jnp.where(kept, dest * buffer + slot, ep_size * buffer), buffer


def _per_device(x, expert_ids, weights, gate, up, down, *biases, axes, ep_size, capacity_factor,
                ep_buffer_factor, implementation, glu, matmul):
  ep, tp, fsdp, replicated = axes["ep"], axes["tp"], axes["fsdp"], axes["replicated"]
  shared = axes["shared"]
  if fsdp:
    gate, up = (jax.lax.all_gather(w, fsdp, axis=1, tiled=True) for w in (gate, up))
    down = jax.lax.all_gather(down, fsdp, axis=2, tiled=True)
  # Weights are the same on devices with different tokens (`replicated`) and tokens the same
  # on devices with different expert slices (`tp`). Mark both as varying over those axes
  # here, so the gradients' sums over them happen once, at this level, and not inside
  # grouped.py's per-block conditional, which devices take differently (a collective there
  # deadlocks).
  if replicated:
    gate, up, down = (jax.lax.pcast(w, replicated, to="varying") for w in (gate, up, down))
  # Biases are whole over FSDP too (no gather whose transpose would sum their gradients).
  if biases and replicated + fsdp:
    biases = tuple(jax.lax.pcast(b, replicated + fsdp, to="varying") for b in biases)
  if tp:
    x = jax.lax.pcast(x, tp, to="varying")
  b, length, dim = x.shape
  k = expert_ids.shape[-1]
  tokens, num_local = b * length, gate.shape[0]
  # One device's assignments, balanced, is what its experts receive on average.
  block = block_rows(tokens * k, num_local)
  if (implementation == "auto" and not ep and capacity_factor is None
      and every_expert_is_cheaper(tokens, num_local, block, tokens * k)):
    # Decode's few tokens: every expert on each token once (not once per choice), one
    # batched matmul and no loop; dropless, as this path is.
    y = routed_experts_reference(x, expert_ids, weights, gate, up, down, biases or None, glu,
                                 matmul).reshape(tokens, dim)
    kept = jnp.ones((b, length, k), bool)
  else:
    y, kept = _through_buffers(x, expert_ids, weights, gate, up, down, biases, ep=ep, ep_size=ep_size,
                               capacity_factor=capacity_factor, ep_buffer_factor=ep_buffer_factor,
                               implementation=implementation, glu=glu, block=block, matmul=matmul)
  if tp:
    y = jax.lax.psum(y, tp)
  if shared:  # the same tokens on these devices, so the same results: say so
    y, kept = jax.lax.pmax(y, shared), jax.lax.pmax(kept.astype(jnp.int32), shared) > 0
  return y.reshape(b, length, dim), kept


def _through_buffers(x, expert_ids, weights, gate, up, down, biases, *, ep, ep_size, capacity_factor,
                     ep_buffer_factor, implementation, glu, block, matmul):
  """Each assignment sent to its expert's device (if ep) in the send buffer, the local
  experts' grouped SwiGLU over what arrived, the results brought home and weighted ->
  (y [T, D] partial over tp, kept bool [B, L, k])."""
  b, length, dim = x.shape
  k = expert_ids.shape[-1]
  tokens, assignments = b * length, b * length * k
  num_local = gate.shape[0]
  # Assignments in choice-major order (a = j x T + t: every token's first choice, then every
  # second choice): a capacity drops later choices first, and on TPU flattening [T, k] with k
  # minor made the index arithmetic below compile 5x slower.
  ids = expert_ids.reshape(tokens, k).T.reshape(assignments).astype(jnp.int32)
  kept, index, buffer = _send_plan(ids, num_local, ep_size, capacity_factor, ep_buffer_factor)
  # What each send-buffer row holds: an assignment, its token and its expert (or nothing).
  owner = inverse(index, ep_size * buffer)
  held = owner[:, 0] < assignments
  row_token = jnp.where(held, owner[:, 0] % tokens, tokens)
  row_expert = jnp.where(held, ids[jnp.minimum(owner[:, 0], assignments - 1)] % num_local, num_local)
  rows = take_rows(x.reshape(tokens, dim), row_token, index.reshape(k, tokens).T)
  exchange = functools.partial(jax.lax.all_to_all, axis_name=ep, split_axis=0, concat_axis=0, tiled=True)
  if ep:
    rows, row_expert = exchange(rows), exchange(row_expert)
  out = grouped_ffn(rows, row_expert, gate, up, down, biases=biases or None, glu=glu,
                    implementation=implementation, block=block, matmul=matmul)
  if ep:
    out = exchange(out)
  mine = take_rows(out, index, owner).reshape(k, tokens, dim)
  # A weighted sum of k rows, in the compute dtype: a float32 result would make its
  # gradient a float32 copy of all T x k rows.
  y = jnp.einsum("tk,ktd->td", weights.reshape(tokens, k).astype(x.dtype), mine)
  return y, kept.reshape(k, tokens).T.reshape(b, length, k)


def routed_experts(x, expert_ids, weights, gate, up, down, *, biases=None, glu=silu_glu, capacity_factor=None,
                   ep_buffer_factor=None, implementation="auto", matmul=None):
  """x [B, L, D]; expert_ids int [B, L, k]; weights [B, L, k]; gate, up [E, D, F];
  down [E, F, D] -> (y [B, L, D], kept bool [B, L, k]).

  y = sum over kept assignments j of weights[..., j] * expert_{expert_ids[..., j]}(x), an
  expert being down(glu(x @ gate + gate_bias, x @ up + up_bias)).
  biases: None or (gate_bias, up_bias) [E, F]; glu: the gated activation (SwiGLU's default).
  capacity_factor: None (dropless) or each expert takes at most ceil(factor x T x k / E) of
    a device's T tokens' assignments: first choices first, each choice in token order.
  ep_buffer_factor: with expert parallelism n and no capacity, rows each device reserves
    per destination as a multiple of its balanced share T x k / n (None: T x k, never full).
  matmul: each expert projection's matmul(x, w) (None: x @ w; a model's train-precision door).
  """
  num_experts, dim, ffn = gate.shape
  ep, tp = mesh_axes("experts", num_experts), mesh_axes("mlp", ffn)
  fsdp = tuple(a for a in mesh_axes("embed", dim) if a not in ep + tp)
  batch = mesh_axes("batch", x.shape[0])
  tokens = batch + mesh_axes("length", x.shape[1])  # context parallelism splits the sequences
  # shared: axes the weights are split over that a batch too small to split (decoding a few
  # rows) is repeated over: every copy computes the same result.
  axes = {"ep": ep, "tp": tp, "fsdp": fsdp, "shared": tuple(a for a in ep + fsdp if a not in tokens),
          "replicated": tuple(a for a in batch if a not in ep + tp + fsdp)}
  mesh = jax.sharding.get_abstract_mesh()
  fn = functools.partial(_per_device, axes=axes, ep_size=math.prod(mesh.shape[a] for a in ep),
                         capacity_factor=capacity_factor, ep_buffer_factor=ep_buffer_factor,
                         implementation=implementation, glu=glu, matmul=matmul)
  biases = tuple(biases or ())
  return logical_shard_map(fn, (_TOKENS, _TOKENS, _TOKENS, _IN, _IN, _OUT) + (_BIAS,) * len(biases),
                           [_TOKENS, _TOKENS])(x, expert_ids, weights, gate, up, down, *biases)
