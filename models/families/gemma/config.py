"""The Gemma families' `model` sections: what Gemma 2 and 3 share, and what tells them apart."""

from jaxpar.models.config import LayerKind, ModelConfig, RopeScaling


class GemmaConfig(ModelConfig):
  """What Gemma 2 and 3 share, as defaults of the model section."""
  layer_block: str = "sandwich_norm"
  mlp_activation: str = "gelu_tanh"
  scale_embeddings: bool = True
  norm_unit_offset: bool = True
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  query_pre_attn_scalar: int | None = 256


class Gemma2Config(GemmaConfig):
  family: str = "gemma2"
  attn_logit_soft_cap: float | None = 50.0
  final_logit_soft_cap: float | None = 30.0
  layer_pattern: tuple[LayerKind, ...] = (LayerKind(sliding_window=4096), LayerKind())


class Gemma3Config(GemmaConfig):
  family: str = "gemma3"
  qk_norm: bool = True
  rope_theta: float = 1_000_000.0
  rope_scaling: RopeScaling | None = RopeScaling(rope_type="linear", factor=8.0)
  layer_pattern: tuple[LayerKind, ...] = (
      (LayerKind(sliding_window=1024, rope_theta=10_000.0, rope_scaling=None),) * 5 + (LayerKind(),))
