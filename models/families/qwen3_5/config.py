"""The `qwen3_5` family's `model` section: Qwen3.5's defaults."""

from jaxpar.models.config import GatedDeltaNetConfig, LayerKind, ModelConfig

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
