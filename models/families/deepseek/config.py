"""The `model` section of the `deepseek` family: the MoE section plus multi-head latent
attention's dims (`model.mla`, read by the `mla` attention block) and multi-token prediction."""

from pydantic import Field

from jaxpar.models.mla_config import MLAConfig
from jaxpar.models.moe_config import MoEModelConfig


class DeepSeekConfig(MoEModelConfig):
  """`attention_block: mla` reads `mla`; with `gqa` (the default) it is unused.
  mtp_depth 1: multi-token prediction (model.py beside this file), an auxiliary loss weighted by
  mtp_loss_weight (DeepSeek-V3: 0.3, then 0.1 for the last 20% of its tokens)."""
  mla: MLAConfig = MLAConfig()
  mtp_depth: int = Field(0, ge=0, le=1)
  mtp_loss_weight: float = Field(0.3, ge=0)
