"""The Gemma families' `model` sections: what Gemma 2, 3 and 4 share, and what tells them apart."""

from pydantic import Field, model_validator

from jaxpar.models.config import LayerKind, ModelConfig, RopeScaling
from jaxpar.models.moe_config import MoEConfig


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


class Gemma4Config(GemmaConfig):
  """Gemma 4 (text): five local layers to one global, as Gemma 3, but the global layers are
  the `gemma4_global` mixer, with heads of their own width (`global_head_dim`), their own
  KV head count, and (`keys_as_values`) values that are their keys. Norms multiply by their
  scale (no unit offset); q, k and v are RMS-normed (v without a scale) and the scores are
  not scaled (query_pre_attn_scalar 1). Global RoPE is proportional: a quarter of the pairs
  turn. Each layer ends with a learned scalar (`gemma4` layer) and, with
  per_layer_input_dim, adds its per-layer input."""
  family: str = "gemma4"
  attention_block: str = "gemma4"
  layer_block: str = "gemma4"
  norm_unit_offset: bool = False
  qk_norm: bool = True
  query_pre_attn_scalar: int | None = 1
  rope_theta: float = 1_000_000.0
  rope_scaling: RopeScaling | None = RopeScaling(rope_type="proportional", factor=1.0, fraction=0.25)
  layer_pattern: tuple[LayerKind, ...] = (
      (LayerKind(sliding_window=512, rope_theta=10_000.0, rope_scaling=None),) * 5 + (LayerKind(mixer="gemma4_global"),))
  global_head_dim: int = Field(64, ge=1)
  global_kv_heads: int | None = Field(None, ge=1)  # None: num_kv_heads
  keys_as_values: bool = False  # the global layers' values are their keys (HF attention_k_eq_v)
  moe: MoEConfig | None = None  # experts beside every layer's MLP (26B-A4B); None: none
  # The layers that reuse an earlier layer's keys and values (pattern mixers gemma4_shared,
  # gemma4_global_shared) have an MLP of twice mlp_dim (HF use_double_wide_mlp).
  double_wide_mlp: bool = False

  @model_validator(mode="after")
  def _global_heads(self):
    if self.num_heads % (self.global_kv_heads or self.num_kv_heads):
      raise ValueError(f"model.global_kv_heads={self.global_kv_heads} must divide model.num_heads={self.num_heads}")
    sources = {"gemma4_shared": "gemma4", "gemma4_global_shared": "gemma4_global"}
    mixers = [(k.mixer or self.attention_block) for k in self.layer_pattern] if self.layer_pattern else []
    for i in range(self.num_layers if mixers else 0):
      mixer = mixers[i % len(mixers)]
      if mixer in sources and sources[mixer] not in [mixers[j % len(mixers)] for j in range(i)]:
        raise ValueError(f"model.layer_pattern: layer {i} ({mixer}) reuses the keys and values of an earlier "
                         f"{sources[mixer]} layer, and none comes before it")
    if self.moe is not None and self.quantization is not None:
      raise ValueError(f"model.quantization.mode={self.quantization.mode} with model.moe: expert weights have no "
                       "quantized kernel yet; keep them float")
    return self

  def global_layers(self) -> "Gemma4Config":
    """This section as the global layers see it: their head width and KV heads."""
    return self.model_copy(update={"head_dim": self.global_head_dim,
                                   "num_kv_heads": self.global_kv_heads or self.num_kv_heads})
