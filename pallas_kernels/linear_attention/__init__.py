"""Gated DeltaNet's delta rule (the linear attention of Qwen3-Next / Qwen3.5) behind one door,
next to its pure-jnp reference and the one-token decode step.

`gated_delta_rule` checks shapes and picks the implementation:
  reference  a scan over tokens (the definition);
  chunked    the WY form in XLA, a scan over chunks (any backend, any decay);
  pallas     the chunked form as the backend's Pallas kernel, forward and backward (kernel.py):
             Mosaic on TPU, Triton on GPU; elsewhere the TPU kernel in interpret mode;
  auto       the kernel on TPU and GPU where it takes the shapes (a decay per head; on GPU
             power-of-two head dims), else chunked.
Kernels run per device inside `jax.shard_map` over the current mesh (batch and heads split).
"""

from jaxpar.errors import ConfigError, UserError
from jaxpar.mesh import logical_shard_map
from jaxpar.pallas_kernels.linear_attention.chunked import gated_delta_rule_chunked
from jaxpar.pallas_kernels.linear_attention.kernel import check_kernel_shapes, gated_delta_rule_pallas
from jaxpar.pallas_kernels.linear_attention.reference import gated_delta_rule_reference, gated_delta_step
from jaxpar.pallas_kernels.platform import current_platform, interpret

IMPLEMENTATIONS = ("auto", "reference", "chunked", "pallas")
# Logical names of the kernel's arguments: key and value heads share one, so a split keeps
# each value head with its key head (contiguous blocks, as attention does under GQA).
_TOKENS = ("batch", None, "act_kv_heads", None)
_PER_HEAD = ("batch", None, "act_kv_heads")
_STATE = ("batch", "act_kv_heads", None, None)

__all__ = ["IMPLEMENTATIONS", "gated_delta_rule", "gated_delta_rule_reference", "gated_delta_step"]


def _check_shapes(q, k, v, g, beta, initial_state, segment_ids):
  for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("beta", beta, 3)):
    if x.ndim != rank:
      raise UserError(f"{name} must have {rank} dims ([batch, length, heads{', head_dim' if rank == 4 else ''}]), "
                      f"got shape {x.shape}")
  batch, length, num_k_heads, key_dim = k.shape
  num_heads, value_dim = v.shape[2:]
  if q.shape != k.shape:
    raise UserError(f"q {q.shape} and k {k.shape} must have the same shape")
  if v.shape[:2] != (batch, length):
    raise UserError(f"v {v.shape} must agree with k {k.shape} on batch and length")
  if num_heads % num_k_heads:
    raise UserError(f"value heads ({num_heads}) must be a multiple of key heads ({num_k_heads})")
  if beta.shape != v.shape[:3]:
    raise UserError(f"beta must be [batch, length, value heads] = {v.shape[:3]}, got shape {beta.shape}")
  if g.shape not in (v.shape[:3], (*v.shape[:3], key_dim)):
    raise UserError(f"g must be [batch, length, value heads] = {v.shape[:3]} (a decay per head) or "
                    f"{(*v.shape[:3], key_dim)} (per key channel), got shape {g.shape}")
  if initial_state is not None and initial_state.shape != (batch, num_heads, key_dim, value_dim):
    raise UserError(f"initial_state must be [batch, value heads, key dim, value dim] = "
                    f"{(batch, num_heads, key_dim, value_dim)}, got shape {initial_state.shape}")
  if segment_ids is not None and segment_ids.shape != (batch, length):
    raise UserError(f"segment_ids must be [batch, length] = {(batch, length)}, got shape {segment_ids.shape}")


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, segment_ids=None, implementation="auto",
                     chunk_size=64):
  """The gated delta rule over a sequence (reference.py defines it): q, k [B, L, Hk, Dk]
  (normalised and scaled by the caller); v [B, L, Hv, Dv]; g (log-decay) [B, L, Hv], or
  [B, L, Hv, Dk] for a decay per key channel (Kimi Delta Attention); beta [B, L, Hv];
  initial_state [B, Hv, Dk, Dv] or None; segment_ids int [B, L] or None (packed sequences)
  -> (out [B, L, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] float32)."""
  if implementation not in IMPLEMENTATIONS:
    raise ConfigError(f"gated delta rule implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
  _check_shapes(q, k, v, g, beta, initial_state, segment_ids)
  if implementation == "reference":
    return gated_delta_rule_reference(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids)
  if not isinstance(chunk_size, int) or chunk_size <= 0:
    raise UserError(f"chunk_size={chunk_size!r} must be a positive int")
  platform = current_platform()
  backend = "gpu" if platform == "gpu" else "tpu"
  if implementation == "auto" and platform in ("tpu", "gpu") and \
      check_kernel_shapes(backend, q, v, g, chunk_size) is None:
    implementation = "pallas"
  if implementation == "pallas":
    return _sharded_kernel(q, k, v, g, beta, initial_state, segment_ids, chunk_size, backend, interpret(platform))
  return gated_delta_rule_chunked(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                                  chunk_size=chunk_size)


def _sharded_kernel(q, k, v, g, beta, initial_state, segment_ids, chunk_size, backend, interpreted):
  """The kernel per device over the current mesh. Interpret mode evaluates the kernel's body
  as ordinary ops, which would mix per-device and replicated values: JAX's check is off there."""
  def per_device(q, k, v, g, beta, initial_state, segment_ids):
    return gated_delta_rule_pallas(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                                   chunk_size=chunk_size, backend=backend, interpret=interpreted)
  return logical_shard_map(per_device, (_TOKENS, _TOKENS, _TOKENS, _PER_HEAD, _PER_HEAD, _STATE, ("batch", None)),
                           [_TOKENS, _STATE], check_vma=not interpreted)(q, k, v, g, beta, initial_state, segment_ids)
