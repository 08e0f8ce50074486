"""Hugging Face names for the `qwen3_moe` family: Qwen3's attention and norms (the shared
decoder layout, models/hf_layout.py) and experts stored one tensor per expert under `mlp`,
stacked here on the `experts` axis."""

from jaxpar.errors import ConfigError
from jaxpar.models.hf_layout import (ATTENTION, TOP, check_values, decoder_config_to_hf, expert_entries,
                                     moe_config_from_hf, windows_to_hf)
from jaxpar.models.moe_config import MoEModelConfig
from jaxpar.models.registry import HFMapping

# What Qwen3-MoE always has: the model section's values it needs.
EXPORTABLE = {"moe.router": "softmax", "moe.shared_mlp_dim": 0, "moe.routed_scale": 1.0, "first_dense_layers": 0,
              "qk_norm": True}


def config_from_hf(hf: dict) -> MoEModelConfig:
  if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
    raise ConfigError(f"qwen3_moe with decoder_sparse_step={hf.get('decoder_sparse_step')}, "
                      f"mlp_only_layers={hf.get('mlp_only_layers')} is not supported: jaxpar's dense "
                      "layers come first (model.first_dense_layers), not interleaved")
  return moe_config_from_hf(hf, family="qwen3_moe", attention_type="qwen3",
                            expert_mlp_dim=hf["moe_intermediate_size"], normalize=bool(hf.get("norm_topk_prob")))


def config_to_hf(cfg, dtype: str) -> dict:
  check_values(cfg, "qwen3_moe", EXPORTABLE)
  m = cfg.moe
  return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
          **decoder_config_to_hf(cfg, dtype), "moe_intermediate_size": m.expert_mlp_dim,
          "num_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
          "norm_topk_prob": m.normalize_weights, "router_aux_loss_coef": m.balance_loss,
          "decoder_sparse_step": 1, "mlp_only_layers": [], **windows_to_hf(cfg, "qwen3_moe")}


MAPPING = HFMapping(model_types=("qwen3_moe",), config_from_hf=config_from_hf, config_to_hf=config_to_hf, top=TOP,
                    layer=ATTENTION + expert_entries("mlp", "gate_proj", "up_proj", "down_proj"))
