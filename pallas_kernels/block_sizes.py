"""Tile sizes for the attention kernels, with defaults per backend and chip."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query/key tile lengths. The backward pass uses its own pair when given."""
  block_q: int
  block_k: int
  block_q_bwd: int | None = None
  block_k_bwd: int | None = None

  @property
  def bwd(self):
    return BlockSizes(self.block_q_bwd or self.block_q, self.block_k_bwd or self.block_k)


# TPU: tiles are multiples of the 128-lane vreg. v6e has twice v5e's VMEM and a
# 256-wide MXU, so it takes longer key tiles; v5e keeps 512 so head_dim 256 with
# 8 query heads per kv head still fits its 16 MiB VMEM.
_TPU_DEFAULTS = {
    "v4": BlockSizes(512, 512),
    "v5e": BlockSizes(512, 512, 256, 512),
    "v5p": BlockSizes(512, 1024, 512, 512),
    "v6e": BlockSizes(512, 1024, 512, 512),
}
# GPU (Triton): tiles live in registers/shared memory, so they are much smaller.
_GPU_DEFAULT = BlockSizes(64, 64, 32, 32)
# CPU chunked path: big enough to amortise scan overhead, small enough for cache.
_CPU_DEFAULT = BlockSizes(512, 512)


def tpu_generation(device_kind):
  """'TPU v5 lite' -> 'v5e', 'TPU v5p' -> 'v5p', 'TPU v6 lite' -> 'v6e', 'TPU v4' -> 'v4'."""
  kind = device_kind.lower()
  for key, name in (("v6", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"), ("v5", "v5p"),
                    ("v4", "v4")):
    if key in kind:
      return name
  return "v6e"  # newer chips: at least v6e's VMEM


def default_block_sizes(platform, device_kind=""):
  """Sane tiles for `platform` ('tpu' | 'gpu' | 'cpu') and the chip's device_kind."""
  if platform == "tpu":
    return _TPU_DEFAULTS[tpu_generation(device_kind)]
  if platform == "gpu":
    return _GPU_DEFAULT
  return _CPU_DEFAULT
