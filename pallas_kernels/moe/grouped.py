"""Grouped SwiGLU: rows sorted by expert, each contiguous group through its own expert.

implementation:
  blocked    (auto) the rows are cut into blocks of one expert each (every group padded to
             whole blocks) and a loop runs one dense SwiGLU per block, skipping empty blocks:
             the matmul work is the real rows plus at most one block per expert, whatever
             the buffer size, on every backend.
  ragged     `jax.lax.ragged_dot`. On CPU XLA expands it to a dense matmul over every
             expert (E times the work), and libtpu compiles its weight gradient the same
             way; measured in benchmarks/moe.py.
  reference  every expert on every row (pallas_kernels/moe/reference.py).
"""

import jax
import jax.numpy as jnp

from jaxpar.pallas_kernels.moe.reference import grouped_ffn_reference, swiglu
from jaxpar.pallas_kernels.tiling import round_up

IMPLEMENTATIONS = ("auto", "blocked", "ragged", "reference")


def block_rows(expected_rows: int, num_groups: int) -> int:
  """Rows per block: about half a group's balanced share, a power of two in [128, 512].
  Padding each group to whole blocks then adds at most ~50% of the real rows; smaller
  blocks cost more loop trips than they save (on CPU, 8192 x 128 -> 256 rows over 8
  experts, forward + backward: blocks of 128 took 2.7x a dense matmul, 256 took 1.4x)."""
  share = max(expected_rows // (2 * num_groups), 1)
  return int(min(512, max(128, 1 << (share.bit_length() - 1))))


def _blocked_ffn(rows, group_sizes, gate, up, down, block):
  num_rows, dim = rows.shape
  groups = group_sizes.shape[0]
  num_blocks = -(-num_rows // block) + groups  # enough for every group's last partial block
  padded = round_up(group_sizes, block)
  padded_ends = jnp.cumsum(padded)
  ends = jnp.cumsum(group_sizes)
  # Row r of the sorted rows: its group and rank -> its slot in the padded layout.
  row_group = jnp.searchsorted(ends, jnp.arange(num_rows), side="right")
  safe = jnp.minimum(row_group, groups - 1)
  rank = jnp.arange(num_rows) - (ends - group_sizes)[safe]
  slot = jnp.where(row_group < groups, padded_ends[safe] - padded[safe] + rank, num_blocks * block)
  blocks = jnp.zeros((num_blocks * block, dim), rows.dtype).at[slot].set(rows, mode="drop")
  block_group = jnp.searchsorted(padded_ends, jnp.arange(num_blocks) * block, side="right")

  def one_block(args):
    x, g = args
    e = jnp.minimum(g, groups - 1)
    return jax.lax.cond(g < groups, lambda: swiglu(x, gate[e], up[e], down[e]),
                        lambda: jnp.zeros_like(x))

  out = jax.lax.map(one_block, (blocks.reshape(num_blocks, block, dim), block_group))
  return jnp.take(out.reshape(-1, dim), slot, axis=0, mode="fill", fill_value=0)


def _ragged_ffn(rows, group_sizes, gate, up, down):
  hidden = (jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes))
            * jax.lax.ragged_dot(rows, up, group_sizes))
  return jax.lax.ragged_dot(hidden, down, group_sizes)


def grouped_ffn(rows, group_sizes, gate, up, down, *, implementation="auto", block=None):
  """rows [R, D] sorted by group; group_sizes int [G] (sum <= R); gate, up [G, D, F];
  down [G, F, D] -> [R, D]. Rows past the last group come out as zeros.
  block: rows per block of the blocked path (default from R and G)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"moe.implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
  group_sizes = group_sizes.astype(jnp.int32)
  if implementation == "reference":
    return grouped_ffn_reference(rows, group_sizes, gate, up, down)
  if implementation == "ragged":
    return _ragged_ffn(rows, group_sizes, gate, up, down)
  return _blocked_ffn(rows, group_sizes, gate, up, down,
                      block or block_rows(rows.shape[0], gate.shape[0]))
