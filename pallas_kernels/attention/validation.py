"""Argument checks that fail with the argument's name, before any kernel is traced."""

from jaxpar.errors import UserError

SUPPORTED_HEAD_DIMS = (64, 128, 256)


def check_attention_args(q, k, v, segment_ids=None, sliding_window=None, logit_soft_cap=None,
                         head_dims=SUPPORTED_HEAD_DIMS):
  """q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D]; segment_ids: [B, Lk]."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise UserError(f"{name} must be [batch, length, heads, head_dim], got shape {x.shape}")
  if k.shape != v.shape:
    raise UserError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise UserError(f"q {q.shape} and k {k.shape} must agree on batch and head_dim")
  if q.shape[1] > k.shape[1]:
    raise UserError(f"q has more positions ({q.shape[1]}) than k ({k.shape[1]})")
  num_heads, num_kv_heads = q.shape[2], k.shape[2]
  if num_heads % num_kv_heads:
    raise UserError(f"q heads ({num_heads}) must be a multiple of k/v heads ({num_kv_heads}) "
                     "for grouped-query attention")
  if head_dims is not None and q.shape[3] not in head_dims:
    raise UserError(f"head_dim={q.shape[3]} is not supported by the flash kernels; "
                     f"use one of {head_dims} or implementation='chunked'")
  if segment_ids is not None and segment_ids.shape != k.shape[:2]:
    raise UserError(f"segment_ids must be [batch, kv_length] = {k.shape[:2]}, "
                     f"got {segment_ids.shape}")
  if sliding_window is not None and sliding_window < 1:
    raise UserError(f"sliding_window={sliding_window} must be >= 1")
  if logit_soft_cap is not None and logit_soft_cap <= 0:
    raise UserError(f"logit_soft_cap={logit_soft_cap} must be > 0")

