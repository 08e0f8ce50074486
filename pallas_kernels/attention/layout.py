"""How a sequence is laid out over the devices that split its length (context parallelism).

contiguous: device d holds tokens [d * L/N, (d+1) * L/N). Under a causal mask the last
  device does N times the attention work of the first.
zig-zag: the sequence is cut into 2N chunks and device d holds chunks d and 2N-1-d, so
  every device holds one early and one late chunk and does the same causal work. The
  train step reorders a batch into this order once (`zigzag`); positions, segment ids,
  targets and the loss mask are reordered with the tokens.
"""

import dataclasses
import functools
import itertools

import jax.numpy as jnp
from jax import lax

from jaxpar.mesh import logical_shard_map, mesh_axes, num_shards
from jaxpar.pallas_kernels.attention import masking
from jaxpar.pallas_kernels.attention.spec import CausalMask


def zigzag(x, shards: int):
  """[B, L, ...] in natural order -> zig-zag order for `shards` devices (L a multiple of
  2 * shards). An array the current mesh splits that way along `length` is reordered in
  place by two ppermutes (each device sends its two chunks where they belong); any other
  is permuted whole."""
  if shards > 1 and num_shards("length") == shards and x.shape[1] % (2 * shards) == 0:
    names = ("batch", "length") + (None,) * (x.ndim - 2)
    return logical_shard_map(functools.partial(_zigzag_here, axes=mesh_axes("length"),
                                               shards=shards), (names,), names)(x)
  chunks = x.reshape(x.shape[0], 2 * shards, x.shape[1] // (2 * shards), *x.shape[2:])
  paired = jnp.stack([chunks[:, :shards], chunks[:, shards:][:, ::-1]], axis=2)  # [B, N, 2, c, ...]
  return paired.reshape(x.shape)


def _zigzag_here(x, *, axes, shards):
  """Per device: natural chunks 2d, 2d+1 in hand -> zig-zag chunks d, 2N-1-d."""
  half = x.shape[1] // 2
  home = lambda chunk: chunk if chunk < shards else 2 * shards - 1 - chunk  # its device
  evens = lax.ppermute(x[:, :half], axes, [(d, home(2 * d)) for d in range(shards)])
  odds = lax.ppermute(x[:, half:], axes, [(d, home(2 * d + 1)) for d in range(shards)])
  # Device d's early chunk d has d's parity; its late chunk 2N-1-d the other one.
  even_device = lax.axis_index(axes) % 2 == 0
  return jnp.concatenate([jnp.where(even_device, evens, odds), jnp.where(even_device, odds, evens)],
                         axis=1)


def unzigzag(x, shards: int):
  """[B, L, ...] in zig-zag order -> natural order (the inverse of `zigzag`, whole arrays)."""
  paired = x.reshape(x.shape[0], shards, 2, x.shape[1] // (2 * shards), *x.shape[2:])
  natural = jnp.concatenate([paired[:, :, 0], paired[:, ::-1, 1]], axis=1)
  return natural.reshape(x.shape)


def piece(pieces, i):
  """Piece i of [pieces, ...] (None stays None: absent segment ids)."""
  return None if pieces is None else pieces[i]


@dataclasses.dataclass(frozen=True)
class SequenceSplit:
  """The length axis split over the mesh axes `axes` (`shards` devices in all), in zig-zag
  order or contiguous."""
  axes: tuple[str, ...]
  shards: int
  zigzag: bool

  @property
  def multiple(self) -> int:
    """What the sequence length must be a multiple of."""
    return 2 * self.shards if self.zigzag else self.shards

  @property
  def pieces(self) -> int:
    """Contiguous pieces of the sequence per device: 2 in zig-zag order, else 1."""
    return 2 if self.zigzag else 1

  def starts(self, index, piece_len: int):
    """int32 [pieces]: where device `index`'s pieces start in the sequence (`index` may be
    traced: the device's place on the ring)."""
    if not self.zigzag:
      return jnp.stack([index * piece_len]).astype(jnp.int32)
    return jnp.stack([index * piece_len, (2 * self.shards - 1 - index) * piece_len]).astype(jnp.int32)

  def split(self, x):
    """This device's [B, L/N, ...] -> its pieces [pieces, B, n, ...] (None stays None)."""
    if x is None:
      return None
    return jnp.moveaxis(x.reshape(x.shape[0], self.pieces, -1, *x.shape[2:]), 1, 0)

  def join(self, x):
    """[pieces, B, n, ...] -> [B, pieces * n, ...] (the inverse of `split`)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])

  def causal_tiles(self, length: int, block: int) -> list[int]:
    """Per device: the block x block tiles of (query, key) pairs that a causal mask leaves
    live, for its query pieces against every key piece of the sequence: the tiles the
    kernels compute (they skip the others by the same masking.kv_block_range)."""
    n = length // self.shards // self.pieces
    starts = [int(s) for d in range(self.shards) for s in self.starts(d, n)]
    work = []
    for d in range(self.shards):
      tiles = 0
      for q_pos in self.starts(d, n):
        for k_pos, lo in itertools.product(starts, range(0, n, block)):
          offset = int(q_pos) - k_pos + lo
          first, last = masking.kv_block_range(offset, offset + min(block, n - lo) - 1, block, CausalMask(),
                                                kv_len=n)
          tiles += max(0, int(last) - int(first) + 1)
      work.append(tiles)
    return work
