"""Index plumbing of expert dispatch: ranks within keys, and row gathers whose gradient is a
gather too.

Both avoid what compiles slowly on TPU at MoE sizes (libtpu, 131k token-assignments on one
v5p chip): an argsort (9.8 s to compile), a cumulative sum down a long axis (26 s), and the
scatter-add that is a gather's default gradient (the dispatch of 65k tokens through 8
experts, forward and backward, compiled in 81 s with these gathers, 168 s without).
"""


import jax
import jax.numpy as jnp

# Up to this many distinct keys, ranks come from a running count per key ([N, keys] int32);
# beyond it, from a stable sort.
MAX_COUNTED_KEYS = 64


def rank_within(keys, num_keys: int):
  """For int keys [N] in [0, num_keys): each element's rank among the elements with the same
  key, in index order (0 for the first)."""
  if num_keys <= MAX_COUNTED_KEYS:
    counts = _running_count(jax.nn.one_hot(keys, num_keys, dtype=jnp.float32))
    return jnp.take_along_axis(counts, keys[:, None], axis=1)[:, 0].astype(keys.dtype) - 1
  order = jnp.argsort(keys, stable=True)
  counts = jnp.zeros((num_keys,), jnp.int32).at[keys].add(1)
  starts = jnp.cumsum(counts) - counts
  ranks = jnp.arange(keys.shape[0], dtype=keys.dtype) - starts[keys[order]]
  return jnp.zeros_like(keys).at[order].set(ranks)


def _running_count(ones, block: int = 256):
  """Inclusive cumulative sum down axis 0 of a 0/1 float32 [N, K]: within blocks of rows as a
  matmul with a lower-triangular matrix, plus each block's offset (a short cumsum). Exact:
  counts stay far below 2^24."""
  n, k = ones.shape
  block = min(block, n)
  padded = -(-n // block) * block
  blocks = jnp.pad(ones, ((0, padded - n), (0, 0))).reshape(padded // block, block, k)
  within = jnp.einsum("ij,njk->nik", jnp.tril(jnp.ones((block, block), jnp.float32)), blocks,
                      precision=jax.lax.Precision.HIGHEST)
  offsets = jnp.cumsum(within[:, -1], axis=0) - within[:, -1]
  return (within + offsets[:, None]).reshape(padded, k)[:n]


@jax.custom_vjp
def take_rows(x, index, readers):
  """x [N, D]; index int [M] -> x[index] [M, D] (index N or more: a zero row).

  readers int [N, S]: for each row of x, every output row that reads it (M or more: none).
  The gradient is a gather of the output's cotangent through `readers` (summed over S),
  so `readers` must be exactly the inverse of `index`.
  """
  return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x, index, readers):
  return take_rows(x, index, readers), (readers, x.shape[0])


def _take_rows_bwd(residuals, cotangent):
  readers, rows = residuals
  read = jnp.take(cotangent, readers.reshape(-1), axis=0, mode="fill", fill_value=0)
  return read.reshape(rows, readers.shape[1], -1).sum(1), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def inverse(index, size: int):
  """For an injective index [M] into [0, size) (size or more: unused), the position in
  index of each of the `size` slots, as readers [size, 1] (M: nobody)."""
  return jnp.full((size,), index.shape[0], jnp.int32).at[index].set(
      jnp.arange(index.shape[0], dtype=jnp.int32), mode="drop")[:, None]
