"""The `model` section of the `kimi_linear` family: Kimi Delta Attention layers and
multi-head latent attention without positions, three to one, over DeepSeek-V3's experts."""

from jaxpar.models.config import GatedDeltaNetConfig, LayerKind
from jaxpar.models.mla_config import MLAConfig
from jaxpar.models.moe_config import MoEConfig, MoEModelConfig

KDA = LayerKind(mixer="gated_deltanet")
NOPE = LayerKind(rope=False)  # Kimi Linear's latent attention has no rotary embedding at all


class KimiLinearConfig(MoEModelConfig):
  """The full-attention layers are `mla` whose "rotary" key part is shared by the heads but
  never rotated (a pattern entry with rope: false); the linear layers are `gated_deltanet`
  with `variant: kimi`. The first `first_dense_layers` are dense, the rest DeepSeek-V3's
  sigmoid-routed experts with a shared expert."""
  family: str = "kimi_linear"
  attention_block: str = "mla"
  mla: MLAConfig = MLAConfig()
  layer_pattern: tuple[LayerKind, ...] = (KDA, KDA, KDA, NOPE)
  gated_deltanet: GatedDeltaNetConfig | None = GatedDeltaNetConfig(num_key_heads=4, num_value_heads=4,
                                                                   variant="kimi")
  first_dense_layers: int = 1
  norm_eps: float = 1e-5
  moe: MoEConfig = MoEConfig(router="sigmoid", shared_mlp_dim=256, balance_loss=0.0, router_z_loss=0.0,
                             bias_update_rate=0.001)
