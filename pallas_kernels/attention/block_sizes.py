"""Tile sizes for the attention kernels, with defaults per backend and chip."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Query/key tile lengths. The backward pass uses its own pair when given.

  vmem_limit_bytes (TPU only) raises Mosaic's scoped-VMEM limit (16 MiB on v5,
  32 MiB on v6e by default): all query heads of a kv head share one tile, so
  large head_dim x group tiles need more.
  """
  block_q: int
  block_k: int
  block_q_bwd: int | None = None
  block_k_bwd: int | None = None
  vmem_limit_bytes: int | None = None

  @property
  def bwd(self):
    return BlockSizes(self.block_q_bwd or self.block_q, self.block_k_bwd or self.block_k,
                      vmem_limit_bytes=self.vmem_limit_bytes)


_MiB = 1 << 20
# TPU: tiles are multiples of the 128-lane vreg. Physical VMEM per core is 16 MiB
# on v4, 64 MiB on v5p and 128 MiB on v5e/v6e; the limits leave headroom for
# head_dim 256 with 8 query heads per kv head. v5p/v6e have the faster MXUs, so
# longer key tiles amortise the per-step softmax bookkeeping.
_TPU_DEFAULTS = {
    "v4": BlockSizes(256, 512, 256, 256),
    "v5e": BlockSizes(512, 512, 512, 512, vmem_limit_bytes=48 * _MiB),
    "v5p": BlockSizes(512, 1024, 512, 512, vmem_limit_bytes=48 * _MiB),
    "v6e": BlockSizes(512, 1024, 512, 512, vmem_limit_bytes=96 * _MiB),
}
# Heads of 512 (Gemma 4's global layers): a kv head's query tile holds group x block_q rows
# of 512. At 8 query heads per kv head, v5e's and v6e's defaults compile, v5p's 64 MiB need
# 256-row query tiles, and v4's 16 MiB hold none (validation.flash_head_dims leaves it out).
_TPU_WIDE_HEADS = {"v5p": BlockSizes(256, 1024, 256, 1024, vmem_limit_bytes=48 * _MiB)}
WIDE_HEAD_DIM = 512
# GPU (Triton): tiles live in registers/shared memory, so they are much smaller. 64 x 64 for
# the backward too: on an H200 (D128, bf16) it ran 4.9 ms against 32 x 32's 11 ms.
_GPU_DEFAULT = BlockSizes(64, 64, 64, 64)
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


def default_block_sizes(platform, device_kind="", head_dim=None):
  """Sane tiles for `platform` ('tpu' | 'gpu' | 'cpu'), the chip's device_kind and the heads' width."""
  if platform == "tpu":
    generation = tpu_generation(device_kind)
    if head_dim is not None and head_dim >= WIDE_HEAD_DIM and generation in _TPU_WIDE_HEADS:
      return _TPU_WIDE_HEADS[generation]
    return _TPU_DEFAULTS[generation]
  if platform == "gpu":
    return _GPU_DEFAULT
  return _CPU_DEFAULT
