"""The `model` section of a config: the architecture a family builds.

Plain pydantic (no jaxpar imports), so a model family can extend it with its own fields
by subclassing `ModelConfig` and naming the subclass in its registry entry.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


class Frozen(BaseModel):
  """Immutable, and unknown keys are errors rather than silently ignored."""
  model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class RopeScaling(Frozen):
  """Llama-3 style frequency scaling of RoPE."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


class ModelConfig(Frozen):
  family: str = "llama"  # a registered model family (jaxpar.models.registry)
  mlp: str = "dense"  # the feed-forward block: a registered block name
  first_dense_layers: int = 0  # the first N layers use the dense block whatever `mlp` says
  vocab_size: int = 512
  embed_dim: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 32
  mlp_dim: int = 512
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qk_norm: bool = False
  attention_bias: bool = False  # q/k/v projection biases (Qwen2 / Qwen2.5)
  param_dtype: Literal["float32", "bfloat16"] = "float32"
  compute_dtype: Literal["float32", "bfloat16"] = "float32"
  scan_layers: bool = True
  # Layers per scan iteration. On CPU, unrolling a small stack halves the backward time
  # (XLA CPU runs the while loop's per-layer gradient updates poorly); compile time grows.
  scan_unroll: int = 1
  remat: Literal["none", "full", "save_dots", "save_dots_no_batch"] = "none"
  attention: Literal["auto", "flash", "reference", "chunked"] = "auto"
  # With mesh.context > 1: how attention crosses devices. all_gather: gather keys/values
  # (cheap with few kv heads); ring: pass key/value blocks around the ring (less memory).
  context_parallel: Literal["all_gather", "ring"] = "all_gather"
  # Zig-zag order over the context devices (device i holds chunks i and 2N-1-i), so each
  # does the same causal work; the train step reorders each batch once.
  context_load_balance: bool = True
  # Megatron sequence parallelism: with mesh.tensor > 1, split the residual stream (norms,
  # residual adds) along length over `tensor` too, instead of repeating it on each device.
  sequence_parallel: bool = False

  @model_validator(mode="after")
  def _heads(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                       f"model.num_heads={self.num_heads}")
    if not 0 <= self.first_dense_layers <= self.num_layers:
      raise ValueError(f"model.first_dense_layers={self.first_dense_layers} must be between 0 and "
                       f"model.num_layers={self.num_layers}")
    return self
