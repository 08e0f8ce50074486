"""Grouped SwiGLU: each row through the expert its group names. Every path takes optional
per-expert gate/up biases, the gated activation `glu(gate, up)` (default silu(gate) * up) and
the matmul each expert projection runs (`matmul(x [R, D], w [D, F])`, default x @ w; a model
passes its train-precision door, models/low_precision.py). With a low-precision matmul, the
blocked path quantizes each block of rows with its expert's weight (a scale never spans two
experts or two blocks); the every-expert path quantizes all of a device's rows against each
expert's weight (rows routed elsewhere carry no gradient). ragged has no such form.

implementation:
  auto       `blocked`, or `reference` where every expert on every row is no more work than
             a padded block for each expert that gets a row (`every_expert_is_cheaper`):
             decode's few rows (a block of 128 rows for each expert that got one of 16).
  blocked    rows are laid out by group, each group padded to whole blocks of
             `block` rows, and a loop runs one dense SwiGLU per block, skipping empty blocks:
             the matmul work is the real rows plus at most one block per expert, whatever
             the buffer size, on every backend.
  ragged     `jax.lax.ragged_dot` over the rows sorted by group. On CPU XLA expands it to a
             dense matmul over every expert (E times the work), and libtpu compiles its
             weight gradient the same way; measured in benchmarks/moe.py.
  reference  every expert on every row (pallas_kernels/moe/reference.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.errors import ConfigError
from jaxpar.pallas_kernels.moe.reference import grouped_ffn_reference, silu_glu
from jaxpar.pallas_kernels.moe.rows import inverse, rank_within, take_rows
from jaxpar.pallas_kernels.tiling import round_up

IMPLEMENTATIONS = ("auto", "blocked", "ragged", "reference")


def block_rows(expected_rows: int, num_groups: int) -> int:
  """Rows per block: about half a group's balanced share, a power of two in [128, 512].
  Padding each group to whole blocks then adds at most ~50% of the real rows; smaller
  blocks cost more loop trips than they save (on CPU, 8192 x 128 -> 256 rows over 8
  experts, forward + backward: blocks of 128 took 2.7x a dense matmul, 256 took 1.4x)."""
  share = max(expected_rows // (2 * num_groups), 1)
  return int(min(512, max(128, 1 << (share.bit_length() - 1))))


def _biased(y, biases, which, groups):
  """y plus the `which` (0: gate, 1: up) bias of each row's group (`groups` a scalar or [R])."""
  return y if biases is None else y + biases[which][groups]


def _blocked_ffn(rows, groups, gate, up, down, biases, glu, block, matmul):
  num_rows, dim = rows.shape
  num_groups = gate.shape[0]
  num_blocks = -(-num_rows // block) + num_groups  # room for every group's last partial block
  sizes = jnp.zeros((num_groups,), jnp.int32).at[groups].add(1, mode="drop")
  padded = round_up(sizes, block)
  padded_ends = jnp.cumsum(padded)
  # Row r goes to slot (its group's first padded slot + its rank in the group).
  group = jnp.minimum(groups, num_groups - 1)
  slot = jnp.where(groups < num_groups, padded_ends[group] - padded[group] + rank_within(groups, num_groups + 1),
                   num_blocks * block)
  holder = inverse(slot, num_blocks * block)  # the row each slot holds (num_rows: none)
  blocks = take_rows(rows, holder[:, 0], slot[:, None])
  block_group = jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * block, side="right")

  def expert(x, e):
    hidden = glu(checkpoint_name(_biased(matmul(x, gate[e]), biases, 0, e), "moe_gate"),
                 checkpoint_name(_biased(matmul(x, up[e]), biases, 1, e), "moe_up"))
    return matmul(hidden, down[e])

  # For the backward pass keep each block's two hidden activations (as a dense MLP does)
  # and nothing else: saving the weight slices would store a [D, F] copy per block.
  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(
      "moe_gate", "moe_up"))
  def one_block(args):
    x, g = args
    return jax.lax.cond(g < num_groups, lambda: expert(x, jnp.minimum(g, num_groups - 1)),
                        lambda: _zeros_varying_like(x, gate, up, down, *(biases or ())))

  out = jax.lax.map(one_block, (blocks.reshape(num_blocks, block, dim), block_group))
  return take_rows(out.reshape(-1, dim), slot, holder)


def _zeros_varying_like(x, *weights):
  """Zeros like x that vary over every mesh axis x or the weights vary over (inside
  shard_map), as expert(x) does: both branches of a cond must agree."""
  varying = lambda a: jax.typeof(a).manual_axis_type.varying  # noqa: E731
  missing = set().union(*(varying(w) for w in weights)) - varying(x)
  zeros = jnp.zeros_like(x)
  return jax.lax.pcast(zeros, tuple(sorted(missing)), to="varying") if missing else zeros


def _ragged_ffn(rows, groups, gate, up, down, biases, glu):
  num_groups = gate.shape[0]
  order = jnp.argsort(groups, stable=True)
  sizes = jnp.zeros((num_groups,), jnp.int32).at[groups].add(1, mode="drop")
  x, sorted_groups = rows[order], groups[order]
  # Rows of no expert (sorted last) get no bias: their hidden must stay zero.
  bias_groups = jnp.minimum(sorted_groups, num_groups - 1)
  project = lambda w, which: jnp.where(  # noqa: E731
      (sorted_groups < num_groups)[:, None], _biased(jax.lax.ragged_dot(x, w, sizes), biases, which, bias_groups), 0)
  hidden = glu(project(gate, 0), project(up, 1))
  return jnp.zeros_like(rows).at[order].set(jax.lax.ragged_dot(hidden, down, sizes))


def grouped_ffn(rows, groups, gate, up, down, *, biases=None, glu=silu_glu, implementation="auto", block=None,
                matmul=None):
  """rows [R, D]; groups int [R] in [0, G] -> [R, D]: row r through expert groups[r]
  (gate, up [G, D, F]; down [G, F, D]; biases None or (gate_bias, up_bias) [G, F]; glu the
  gated activation); rows of group G (no expert) come out as zeros.
  block: rows per block of the blocked path (default from R and G).
  matmul: each projection's matmul (None: x @ w in float)."""
  if implementation not in IMPLEMENTATIONS:
    raise ConfigError(f"moe.implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
  groups = groups.astype(jnp.int32)
  block = block or block_rows(rows.shape[0], gate.shape[0])
  if implementation == "auto" and every_expert_is_cheaper(rows.shape[0], gate.shape[0], block):
    implementation = "reference"
  if implementation == "reference":
    return grouped_ffn_reference(rows, groups, gate, up, down, biases, glu, matmul)
  if implementation == "ragged":
    if matmul is not None:
      raise ConfigError(RAGGED_IS_FLOAT_ONLY)
    return _ragged_ffn(rows, groups, gate, up, down, biases, glu)
  return _blocked_ffn(rows, groups, gate, up, down, biases, glu, block, matmul or jnp.matmul)


RAGGED_IS_FLOAT_ONLY = ("moe.implementation=ragged multiplies in the compute dtype only (lax.ragged_dot takes no "
                        "quantized operands): use moe.implementation=auto or blocked with model.train_precision")


def every_expert_is_cheaper(num_rows: int, num_groups: int, block: int, assignments: int | None = None) -> bool:
  """Whether running every expert on every row (num_rows x num_groups rows of matmul work)
  costs no more than the blocked path does when the rows' assignments (default one each)
  spread over the experts: a padded block of `block` rows for each expert that gets one."""
  return num_rows * num_groups <= min(assignments or num_rows, num_groups) * block
