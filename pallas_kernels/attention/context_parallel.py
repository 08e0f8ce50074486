"""Attention over a sequence whose length the mesh splits (mesh.context > 1).

The door (`dispatch.attention`) comes here when the logical `length` axis maps to mesh
axes larger than 1. Two strategies, both per device through the logical `shard_map`
helper, both running the blockwise kernel of the backend on each piece:

  all_gather  keys/values gathered, queries stay split (all_gather.py)
  ring        key/value blocks passed around the ring with ppermute (ring.py)

Anything that cannot be split is an error here, never a silent gather of the sequence.
"""

from jaxpar.errors import ConfigError, UserError
from jaxpar.mesh import logical_shard_map, mesh_axes, num_shards
from jaxpar.pallas_kernels.attention import chunked, flash_gpu, flash_tpu
from jaxpar.pallas_kernels.attention.all_gather import all_gather_attention
from jaxpar.pallas_kernels.attention.layout import SequenceSplit
from jaxpar.pallas_kernels.attention.ring import ring_attention

STRATEGIES = {"all_gather": all_gather_attention, "ring": ring_attention}


def length_split(zigzag: bool) -> SequenceSplit | None:
  """How the current mesh splits the logical `length` axis (None: it does not)."""
  axes = mesh_axes("length")
  return SequenceSplit(axes, num_shards("length"), zigzag) if axes else None


def blockwise_kernel(implementation: str, platform: str):
  """The blockwise implementation that runs each piece: the flash kernel of the backend
  (resolved 'flash'), else the chunked path."""
  if implementation != "flash":
    return chunked.BLOCKWISE
  return flash_gpu.BLOCKWISE if platform == "gpu" else flash_tpu.BLOCKWISE


def check_split(split: SequenceSplit, q, k, strategy: str, implementation: str):
  """One-line errors for what context parallelism cannot do, before anything is traced."""
  if strategy not in STRATEGIES:
    raise ConfigError(f"context_parallel={strategy!r} is not one of {sorted(STRATEGIES)}")
  if implementation == "reference":
    raise UserError("attention implementation 'reference' materialises whole score matrices "
                     f"and has no context-parallel form (the mesh splits length over "
                     f"{split.axes}): use 'auto', 'chunked' or 'flash'")
  if q.shape[1] != k.shape[1]:
    raise UserError(f"context parallelism splits self-attention only, got {q.shape[1]} queries "
                     f"and {k.shape[1]} keys")
  if q.shape[1] % split.multiple:
    why = " (zig-zag order: 2 chunks per device)" if split.zigzag else ""
    raise UserError(f"sequence length {q.shape[1]} does not split evenly over the "
                     f"{split.shards} devices of mesh axes {split.axes}: it must be a multiple "
                     f"of {split.multiple}{why}; pad the sequences or change their length")


def context_parallel_attention(q, k, v, segment_ids, sinks, *, split, strategy, kernel, spec):
  """q, k, v: [B, L, H, D] split along L as `split` says; sinks [Hq] or None ->
  [B, L, Hq, D], split alike."""
  sequence = ("batch", "length", "act_kv_heads", "head_dim")
  attend = STRATEGIES[strategy]
  st = (split, kernel, spec)
  per_device = lambda q, k, v, seg, sinks: attend(st, q, k, v, sinks, seg, seg)
  return logical_shard_map(per_device, (sequence, sequence, sequence, ("batch", "length"), ("act_kv_heads",)),
                           sequence)(q, k, v, segment_ids, sinks)
