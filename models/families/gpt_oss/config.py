"""The `gpt_oss` family's `model` section: GPT-OSS's attention and experts as defaults."""

from jaxpar.models.config import LayerKind, RopeScaling
from jaxpar.models.moe_config import ExpertActivation, MoEConfig, MoEModelConfig


class GptOssMoEConfig(MoEConfig):
  """GPT-OSS's experts as defaults, so a config's `moe:` section keeps them."""
  router_bias: bool = True
  expert_bias: bool = True
  activation: ExpertActivation = "clamped_swiglu"
  balance_loss: float = 0.001
  router_z_loss: float = 0.0


class GptOssConfig(MoEModelConfig):
  family: str = "gpt_oss"
  attention_bias: bool = True
  attention_out_bias: bool = True
  attention_sinks: bool = True
  rope_theta: float = 150_000.0
  rope_scaling: RopeScaling | None = RopeScaling(rope_type="yarn", factor=32.0, original_max_position=4096,
                                                 truncate=False)
  layer_pattern: tuple[LayerKind, ...] = (LayerKind(sliding_window=128), LayerKind())
  moe: GptOssMoEConfig = GptOssMoEConfig()
