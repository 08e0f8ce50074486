"""Streaming DiLoCo's fragments: which part of each parameter a fragment syncs.

The layers split into `count` blocks (fragment p holds layers [p n / count, (p + 1) n / count)
of every stacked layer group of n); the parameters outside the stacks (embeddings, the
final norm) travel with fragment 0. One fragment holds everything. Where the layer axis is
itself split over devices (a pipeline's `stage`), the blocks are taken inside each device's
share: fragment p holds the p-th block of every stage's layers, so a piece stays split as its
parameter is (each stage syncs its own layers, in place) and every stage sends at every sync.
"""

from dataclasses import dataclass

from jaxpar.errors import ConfigError


@dataclass(frozen=True)
class Part:
  """Rows [start, stop) of each of `shards` equal runs along a leaf's layer axis; the whole
  leaf when start == stop."""
  start: int
  stop: int
  shards: int = 1

  def size(self, rows: int) -> int:
    return rows if self.start == self.stop else self.shards * (self.stop - self.start)


class Fragments:
  """axis_names: the trained parameters' logical axis names as a flat list (one tuple per leaf);
  layer_shards: per leaf, how many devices its first axis is split over."""

  def __init__(self, axis_names: list[tuple], shapes: list[tuple], count: int, layer_shards: list[int]):
    self.count = count
    self._stacked = [bool(names) and names[0] == "layers" for names in axis_names]
    self._shards = layer_shards
    for stacked, shape, shards in zip(self._stacked, shapes, layer_shards):
      if stacked and (shape[0] // shards) % count:
        where = f" per pipeline stage ({shards} stages)" if shards > 1 else ""
        raise ConfigError(f"train.diloco.fragments={count} does not divide a stack of {shape[0] // shards} "
                          f"layers{where}: pick a divisor of that layer count")

  def parts(self, fragment: int, shapes: list[tuple]) -> list[Part | None]:
    """Per leaf: its Part, or None when the fragment does not hold it."""
    out = []
    for stacked, shape, shards in zip(self._stacked, shapes, self._shards):
      if stacked:
        size = shape[0] // shards // self.count
        out.append(Part(fragment * size, (fragment + 1) * size, shards))
      else:
        out.append(Part(0, 0) if fragment == 0 else None)
    return out

  def due(self, step: int, every: int) -> int | None:
    """The fragment that syncs after inner step `step` (1-based), if any: fragment p at steps
    (p + 1) every / count modulo every, so the syncs are evenly staggered."""
    offset = step % every
    gap = every // self.count
    if offset % gap:
      return None
    return (offset // gap - 1) % self.count


def _runs(leaf, part: Part, axis: int):
  """The leaf with its layer axis viewed as [shards, rows per shard]."""
  shape = leaf.shape
  return leaf.reshape(*shape[:axis], part.shards, shape[axis] // part.shards, *shape[axis + 1:])


def take(leaf, part: Part, axis: int = 0):
  """The fragment's piece of a leaf (`axis`: where its layer axis is)."""
  if part.start == part.stop:
    return leaf
  piece = _runs(leaf, part, axis)[(slice(None),) * (axis + 1) + (slice(part.start, part.stop),)]
  return piece.reshape(*leaf.shape[:axis], part.size(leaf.shape[axis]), *leaf.shape[axis + 1:])


def put(leaf, piece, part: Part, axis: int = 0):
  if part.start == part.stop:
    return piece.astype(leaf.dtype)
  runs = _runs(leaf, part, axis)
  piece = piece.reshape(*runs.shape[:axis + 1], part.stop - part.start, *runs.shape[axis + 2:])
  runs = runs.at[(slice(None),) * (axis + 1) + (slice(part.start, part.stop),)].set(piece.astype(leaf.dtype))
  return runs.reshape(leaf.shape)
