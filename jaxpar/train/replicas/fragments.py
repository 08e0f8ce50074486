"""Streaming DiLoCo's fragments: which part of each parameter a fragment syncs.

The layers split into `count` contiguous blocks (fragment p holds layers [p n / count,
(p + 1) n / count) of every stacked layer group of n); the parameters outside the stacks
(embeddings, the final norm) travel with fragment 0. One fragment holds everything.
"""

from jaxpar.errors import ConfigError


class Fragments:
  """axis_names: the trained parameters' logical axis names as a flat list (one tuple per leaf)."""

  def __init__(self, axis_names: list[tuple], shapes: list[tuple], count: int):
    self.count = count
    for names, shape in zip(axis_names, shapes):
      if names and names[0] == "layers" and shape[0] % count:
        raise ConfigError(f"train.diloco.fragments={count} does not divide a stack of {shape[0]} layers: "
                          "pick a divisor of the model's layer count")
    self._stacked = [bool(names) and names[0] == "layers" for names in axis_names]

  def parts(self, fragment: int, shapes: list[tuple]) -> list[tuple[int, int] | None]:
    """Per leaf: (start, stop) along its layer axis, (0, 0) for the whole leaf, None when
    the fragment does not hold it."""
    out = []
    for stacked, shape in zip(self._stacked, shapes):
      if stacked:
        size = shape[0] // self.count
        out.append((fragment * size, (fragment + 1) * size))
      else:
        out.append((0, 0) if fragment == 0 else None)
    return out

  def due(self, step: int, every: int) -> int | None:
    """The fragment that syncs after inner step `step` (1-based), if any: fragment p at steps
    (p + 1) every / count modulo every, so the syncs are evenly staggered."""
    offset = step % every
    gap = every // self.count
    if offset % gap:
      return None
    return (offset // gap - 1) % self.count


def take(leaf, part, axis: int = 0):
  """The fragment's piece of a leaf (`axis`: where its layer axis is)."""
  start, stop = part
  if start == stop:
    return leaf
  return leaf[(slice(None),) * axis + (slice(start, stop),)]


def put(leaf, piece, part, axis: int = 0):
  start, stop = part
  if start == stop:
    return piece.astype(leaf.dtype)
  return leaf.at[(slice(None),) * axis + (slice(start, stop),)].set(piece.astype(leaf.dtype))
