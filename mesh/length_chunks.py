"""Pieces of a sequence that follow how the mesh splits its length: piece c holds the c-th
part of every device's own span (context parallelism gives each device one span), so cutting
a [B, L, ...] activation into pieces moves nothing between devices.

The fused loss and the chunked feed-forward block loop over these pieces one at a time to
bound the memory of what they compute per token.
"""

from jaxpar.mesh.shard_map import num_shards


def length_spans(length: int) -> int:
  """How many device spans the length is split into here (1 if the split does not divide it)."""
  spans = num_shards("length")
  return spans if length % spans == 0 else 1


def split_length(x, count: int, spans: int):
  """[B, L, ...] -> [count, B, spans, L / (spans * count), ...]."""
  batch, length = x.shape[:2]
  piece = length // spans // count
  return x.reshape(batch, spans, count, piece, *x.shape[2:]).swapaxes(0, 2).swapaxes(1, 2)


def merge_length(pieces):
  """The inverse of `split_length`: [count, B, spans, piece, ...] -> [B, L, ...]."""
  count, batch, spans, piece = pieces.shape[:4]
  return pieces.swapaxes(1, 2).swapaxes(0, 2).reshape(batch, spans * count * piece, *pieces.shape[4:])
