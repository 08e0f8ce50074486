"""Hugging Face names for the `mixtral` family: Mistral's attention and norms (the shared
decoder layout, models/hf_layout.py) and experts stored one tensor per expert under
`block_sparse_moe`, stacked here on the `experts` axis."""

from jaxpar.models.hf_layout import (ATTENTION, TOP, check_values, decoder_config_to_hf, expert_entries,
                                     moe_config_from_hf, windows_to_hf)
from jaxpar.models.moe_config import MoEModelConfig
from jaxpar.models.registry import HFMapping

# What Mixtral always has: the model section's values it needs.
EXPORTABLE = {"moe.router": "softmax", "moe.shared_mlp_dim": 0, "moe.routed_scale": 1.0, "first_dense_layers": 0,
              "moe.normalize_weights": True, "qk_norm": False}


def config_from_hf(hf: dict) -> MoEModelConfig:
  return moe_config_from_hf(hf, family="mixtral", attention_type="mistral", expert_mlp_dim=hf["intermediate_size"],
                            normalize=True)


def config_to_hf(cfg, dtype: str) -> dict:
  check_values(cfg, "mixtral", EXPORTABLE)
  m = cfg.moe
  return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
          **decoder_config_to_hf(cfg, dtype), "intermediate_size": m.expert_mlp_dim,
          "num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
          "router_aux_loss_coef": m.balance_loss, "sliding_window": None, **windows_to_hf(cfg, "mixtral")}


MAPPING = HFMapping(model_types=("mixtral",), config_from_hf=config_from_hf, config_to_hf=config_to_hf, top=TOP,
                    layer=ATTENTION + expert_entries("block_sparse_moe", "w1", "w3", "w2"))
