"""Tile sizes for the quantized matmul kernels, per backend, and fitting them to a shape."""

import dataclasses
import math

from jaxpar.pallas_kernels import tiling


@dataclasses.dataclass(frozen=True)
class MatmulBlocks:
  """Tiles of the output rows (tokens), output columns and the contracted dimension."""
  block_m: int
  block_n: int
  block_k: int


# TPU: N and K tiles are multiples of the 128 lanes; 512 x 512 int8 weight tiles stream at
# full HBM bandwidth while the f32 dequantized tile (1 MiB) and the accumulator stay well
# inside the 16 MiB default scoped VMEM.
TPU_DEFAULT = MatmulBlocks(256, 512, 512)
# GPU (Triton): power-of-two register tiles; an int4 K step is always one group.
GPU_DEFAULT = MatmulBlocks(64, 64, 128)


def check_blocks(blocks: MatmulBlocks, platform: str):
  """TPU: rows in whole int8 sublane tiles (32), N and K in whole lanes (128). GPU: powers
  of two of at least 16 (the smallest tensor-core dot)."""
  gpu = platform == "gpu"
  for name, align in (("block_m", 16 if gpu else 32), ("block_n", 16 if gpu else 128),
                      ("block_k", 16 if gpu else 128)):
    tiling.check_block(name, getattr(blocks, name), align, power_of_two=gpu)


def fit(length: int, block: int, align: int) -> tuple[int, int]:
  """(tile, padded length) for one dimension: a dividing tile when there is one, else
  `block` with the length padded up to a multiple of it."""
  tile = tiling.dividing_block(length, block, align)
  if tile is None:
    return block, tiling.round_up(length, block)
  return tile, length


def fit_k(k: int, block: int, group: int | None, align: int) -> tuple[int, int]:
  """The K tile must hold whole groups as well as whole lanes."""
  return fit(k, block, math.lcm(align, group or 1))
