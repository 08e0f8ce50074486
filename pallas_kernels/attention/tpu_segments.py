"""How the TPU flash kernels see segment ids: a [block, 128] column tile (ids on
sublanes) for the rows of a logits tile and an [8, block] row tile (ids on lanes) for its
columns, so the two broadcast against each other to the tile's mask."""

import jax.numpy as jnp
from jax.experimental import pallas as pl

LANES = 128
SUBLANES = 8


def tile_ids(column_ref, row_ref):
  """Inside a kernel: a column of one side's ids and a row of the other's (or None)."""
  if column_ref is None:
    return None, None
  return column_ref[:, :1], row_ref[:1, :]


def column_spec(block, index):
  """Ids as a column ([block, 128] tile); index(*grid) picks the block."""
  return pl.BlockSpec((None, block, LANES), lambda *g: (g[0], index(*g), 0))


def row_spec(block, index):
  """Ids as a row ([8, block] tile); index(*grid) picks the block."""
  return pl.BlockSpec((None, SUBLANES, block), lambda *g: (g[0], 0, index(*g)))


def layout(seg, column):
  """[B, L] ids -> [B, L, 128] (column tiles) or [B, 8, L] (row tiles); None stays None."""
  if seg is None:
    return None
  if column:
    return jnp.broadcast_to(seg[:, :, None], seg.shape + (LANES,))
  return jnp.broadcast_to(seg[:, None, :], (seg.shape[0], SUBLANES, seg.shape[1]))
