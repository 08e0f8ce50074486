"""Hugging Face names for the MoE families: Mixtral and Qwen3-MoE. Attention and norms are
the llama family's (llama_hf.py); experts are stored one tensor per expert (`{expert}` in
a name), stacked here on the `experts` axis. The conversion machinery is jaxpar/convert/hf.py."""

from jaxpar.errors import ConfigError
from jaxpar.models import llama_hf
from jaxpar.models.moe_config import MoEConfig, MoEModelConfig
from jaxpar.models.registry import HFMapping


def _experts(prefix: str, gate: str, up: str, down: str):
  return (
    (("mlp", "router"), f"{prefix}.gate.weight", "transpose"),
    (("mlp", "gate"), f"{prefix}.experts.{{expert}}.{gate}.weight", "transpose"),
    (("mlp", "up"), f"{prefix}.experts.{{expert}}.{up}.weight", "transpose"),
    (("mlp", "down"), f"{prefix}.experts.{{expert}}.{down}.weight", "transpose"),
  )


def _from_hf(hf: dict, *, family: str, attention_type: str, expert_mlp_dim: int, normalize: bool):
  """Our config from the dense decoder fields (read as `attention_type`) plus the MoE ones."""
  dense = llama_hf.config_from_hf({**hf, "model_type": attention_type})
  num_experts = hf.get("num_local_experts") or hf.get("num_experts")
  moe = MoEConfig(num_experts=num_experts, experts_per_token=hf["num_experts_per_tok"],
                  expert_mlp_dim=expert_mlp_dim, normalize_weights=normalize,
                  balance_loss=hf.get("router_aux_loss_coef", 0.01), router_z_loss=0.0)
  return MoEModelConfig(**dense.model_dump(exclude={"family", "mlp"}), family=family, moe=moe)


def _check_exportable(cfg, kind: str):
  m = cfg.moe
  problems = {"model.moe.router": (m.router, "softmax"), "model.moe.shared_mlp_dim": (m.shared_mlp_dim, 0),
              "model.moe.routed_scale": (m.routed_scale, 1.0),
              "model.first_dense_layers": (cfg.first_dense_layers, 0)}
  if kind == "mixtral":
    problems.update({"model.moe.normalize_weights": (m.normalize_weights, True),
                     "model.qk_norm": (cfg.qk_norm, False)})
  for key, (value, needed) in problems.items():
    if value != needed:
      raise ConfigError(f"{key}={value!r} has no Hugging Face {kind} equivalent (it needs {needed!r})")


def mixtral_from_hf(hf: dict) -> MoEModelConfig:
  return _from_hf(hf, family="mixtral", attention_type="mistral",
                  expert_mlp_dim=hf["intermediate_size"], normalize=True)


def mixtral_to_hf(cfg, dtype: str) -> dict:
  _check_exportable(cfg, "mixtral")
  m = cfg.moe
  return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
          **llama_hf.decoder_config_to_hf(cfg, dtype), "intermediate_size": m.expert_mlp_dim,
          "num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
          "router_aux_loss_coef": m.balance_loss, "sliding_window": None,
          **llama_hf.windows_to_hf(cfg, "mixtral")}


def qwen3_moe_from_hf(hf: dict) -> MoEModelConfig:
  if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
    raise ConfigError(f"qwen3_moe with decoder_sparse_step={hf.get('decoder_sparse_step')}, "
                     f"mlp_only_layers={hf.get('mlp_only_layers')} is not supported: jaxpar's dense "
                     "layers come first (model.first_dense_layers), not interleaved")
  return _from_hf(hf, family="qwen3_moe", attention_type="qwen3",
                  expert_mlp_dim=hf["moe_intermediate_size"], normalize=bool(hf.get("norm_topk_prob")))


def qwen3_moe_to_hf(cfg, dtype: str) -> dict:
  _check_exportable(cfg, "qwen3_moe")
  if not cfg.qk_norm:
    raise ConfigError("model.qk_norm=False has no Hugging Face qwen3_moe equivalent (it needs True)")
  m = cfg.moe
  return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
          **llama_hf.decoder_config_to_hf(cfg, dtype), "moe_intermediate_size": m.expert_mlp_dim,
          "num_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
          "norm_topk_prob": m.normalize_weights, "router_aux_loss_coef": m.balance_loss,
          "decoder_sparse_step": 1, "mlp_only_layers": [], **llama_hf.windows_to_hf(cfg, "qwen3_moe")}


MIXTRAL = HFMapping(model_types=("mixtral",), config_from_hf=mixtral_from_hf, config_to_hf=mixtral_to_hf,
                    top=llama_hf.TOP,
                    layer=llama_hf.ATTENTION + _experts("block_sparse_moe", "w1", "w3", "w2"))
QWEN3_MOE = HFMapping(model_types=("qwen3_moe",), config_from_hf=qwen3_moe_from_hf,
                      config_to_hf=qwen3_moe_to_hf, top=llama_hf.TOP,
                      layer=llama_hf.ATTENTION + _experts("mlp", "gate_proj", "up_proj", "down_proj"))
