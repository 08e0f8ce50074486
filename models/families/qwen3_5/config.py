"""The `model` sections of the Qwen3.5 hybrids: `qwen3_5` (dense), `qwen3_5_moe` and
`qwen3_next` (the same mixture-of-experts model, written in Qwen3-Next's tensor layout)."""

from jaxpar.models.config import GatedDeltaNetConfig, LayerKind, ModelConfig
from jaxpar.models.moe_config import MoEConfig, MoEModelConfig

LINEAR = LayerKind(mixer="gated_deltanet")


class Qwen35Config(ModelConfig):
  family: str = "qwen3_5"
  layer_pattern: tuple[LayerKind, ...] = (LINEAR, LINEAR, LINEAR, LayerKind())
  gated_deltanet: GatedDeltaNetConfig | None = GatedDeltaNetConfig()
  attention_output_gate: bool = True
  qk_norm: bool = True
  norm_unit_offset: bool = True
  rope_fraction: float = 0.25
  norm_eps: float = 1e-6


class Qwen35MoeConfig(Qwen35Config, MoEModelConfig):
  """Every layer's feed-forward block a mixture of experts with a sigmoid-gated shared expert."""
  family: str = "qwen3_5_moe"
  mlp: str = "moe"  # (Qwen35Config's own default would win over MoEModelConfig's)
  moe: MoEConfig = MoEConfig(shared_mlp_dim=256, shared_gate=True, router_z_loss=0.0, balance_loss=0.001)


class Qwen3NextConfig(Qwen35MoeConfig):
  family: str = "qwen3_next"
