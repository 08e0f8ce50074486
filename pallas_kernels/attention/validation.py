"""Argument checks that fail with the argument's name, before any kernel is traced."""

from jaxpar.errors import UserError
from jaxpar.pallas_kernels.attention.block_sizes import WIDE_HEAD_DIM, tpu_generation

# Head dims the flash kernels take. Queries and keys may have another head dim than values
# (multi-head latent attention: 192 and 128); the GPU kernels run a dim that is not a power
# of two (192) zero-padded to the next one (256), since Triton tiles are powers of two.
SUPPORTED_HEAD_DIMS = (64, 128, 192, 256)


def flash_head_dims(platform, device_kind=""):
  """The head dims the flash kernel for `platform` takes: the TPU kernel (also what runs in
  interpret mode off TPU and GPU) takes 512 too, on every chip but v4 (block_sizes.py)."""
  if platform == "gpu" or (platform == "tpu" and tpu_generation(device_kind) == "v4"):
    return SUPPORTED_HEAD_DIMS
  return SUPPORTED_HEAD_DIMS + (WIDE_HEAD_DIM,)


def check_attention_args(q, k, v, segment_ids=None, head_dims=SUPPORTED_HEAD_DIMS, sinks=None):
  """q: [B, Lq, Hq, D]; k: [B, Lk, Hkv, D]; v: [B, Lk, Hkv, Dv]; segment_ids: [B, Lk];
  sinks: [Hq] (the AttentionSpec checks its own options)."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise UserError(f"{name} must be [batch, length, heads, head_dim], got shape {x.shape}")
  if k.shape[:3] != v.shape[:3]:
    raise UserError(f"k and v must agree on batch, length and heads, got k {k.shape} and v {v.shape}")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise UserError(f"q {q.shape} and k {k.shape} must agree on batch and head_dim")
  if q.shape[1] > k.shape[1]:
    raise UserError(f"q has more positions ({q.shape[1]}) than k ({k.shape[1]})")
  num_heads, num_kv_heads = q.shape[2], k.shape[2]
  if num_heads % num_kv_heads:
    raise UserError(f"q heads ({num_heads}) must be a multiple of k/v heads ({num_kv_heads}) "
                     "for grouped-query attention")
  for name, dim in (("head_dim", q.shape[3]), ("v head_dim", v.shape[3])):
    if head_dims is not None and dim not in head_dims:
      raise UserError(f"{name}={dim} is not supported by the flash kernels; "
                       f"use one of {head_dims} or implementation='chunked'")
  if segment_ids is not None and segment_ids.shape != k.shape[:2]:
    raise UserError(f"segment_ids must be [batch, kv_length] = {k.shape[:2]}, "
                     f"got {segment_ids.shape}")
  check_sinks(sinks, q.shape[2])


def check_sinks(sinks, num_heads):
  """Attention sinks are one logit per query head."""
  if sinks is not None and sinks.shape != (num_heads,):
    raise UserError(f"sinks must be [q heads] = ({num_heads},), got shape {sinks.shape}")
