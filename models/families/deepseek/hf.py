"""Hugging Face names for the `deepseek` family: transformers' DeepseekV3 layout
(multi-head latent attention, dense first layers, then shared + routed experts with
node-limited sigmoid routing). Experts are stored one tensor per expert, as the DeepSeek
checkpoints and transformers' saved models have them. The router's `e_score_correction_bias`
(the auxiliary-loss-free balancing bias) is our MoE's `bias`, model state rather than a
parameter; training an import moves it at DeepSeek-V3's rate (model.moe.bias_update_rate).
The multi-token-prediction layer (HF's layer `num_hidden_layers`, which transformers
skips) is not converted: an import has model.mtp_depth 0, an export has no MTP layer
(num_nextn_predict_layers 0)."""

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.families.deepseek.config import DeepSeekConfig
from jaxpar.models.hf_layout import LAYER, TOP, decoder_config_to_hf, rope_from_hf
from jaxpar.models.mla_config import MLAConfig
from jaxpar.models.moe_config import MoEConfig
from jaxpar.models.registry import HFMapping

# DeepSeek-V3's bias update speed (gamma, its paper's section 4.2): HF configs do not carry it.
BIAS_UPDATE_RATE = 0.001

MLA = (
  (("attn", "q"), "self_attn.q_proj.weight", "heads_in"),
  (("attn", "q_a"), "self_attn.q_a_proj.weight", "transpose"),
  (("attn", "q_norm", "scale"), "self_attn.q_a_layernorm.weight", "same"),
  (("attn", "q_b"), "self_attn.q_b_proj.weight", "heads_in"),
  (("attn", "kv_a"), "self_attn.kv_a_proj_with_mqa.weight", "transpose"),
  (("attn", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", "same"),
  (("attn", "kv_b"), "self_attn.kv_b_proj.weight", "heads_in"),
  (("attn", "o"), "self_attn.o_proj.weight", "heads_out"),
  (("attn_norm", "scale"), "input_layernorm.weight", "same"),
  (("mlp_norm", "scale"), "post_attention_layernorm.weight", "same"),
)
EXPERTS = (
  (("mlp", "router"), "mlp.gate.weight", "transpose"),
  (("mlp", "bias"), "mlp.gate.e_score_correction_bias", "same"),  # model state
  (("mlp", "gate"), "mlp.experts.{expert}.gate_proj.weight", "transpose"),
  (("mlp", "up"), "mlp.experts.{expert}.up_proj.weight", "transpose"),
  (("mlp", "down"), "mlp.experts.{expert}.down_proj.weight", "transpose"),
  (("mlp", "shared", "gate"), "mlp.shared_experts.gate_proj.weight", "transpose"),
  (("mlp", "shared", "up"), "mlp.shared_experts.up_proj.weight", "transpose"),
  (("mlp", "shared", "down"), "mlp.shared_experts.down_proj.weight", "transpose"),
)


def moe_from_hf(hf: dict) -> MoEConfig:
  """DeepSeek-V3's experts from its HF fields (n_routed_experts, n_shared_experts, n_group, ...)."""
  return MoEConfig(num_experts=hf["n_routed_experts"], experts_per_token=hf["num_experts_per_tok"],
                   expert_mlp_dim=hf["moe_intermediate_size"],
                   shared_mlp_dim=hf["moe_intermediate_size"] * hf.get("n_shared_experts", 0),
                   router="sigmoid", normalize_weights=bool(hf.get("norm_topk_prob", True)),
                   routed_scale=hf.get("routed_scaling_factor", 1.0), num_groups=hf.get("n_group") or 1,
                   groups_per_token=hf.get("topk_group") or 1, balance_loss=0.0, router_z_loss=0.0,
                   bias_update_rate=BIAS_UPDATE_RATE)


def config_from_hf(hf: dict) -> DeepSeekConfig:
  activations.from_hf(hf, "deepseek_v3", ("silu",))
  if hf.get("attention_bias"):
    raise ConfigError("deepseek_v3 with attention_bias=True is not supported: jaxpar's MLA is bias-free")
  if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
    raise ConfigError(f"deepseek with topk_method={hf.get('topk_method')!r}, scoring_func="
                      f"{hf.get('scoring_func')!r} is not supported: jaxpar implements DeepSeek-V3's "
                      "noaux_tc sigmoid routing")
  theta, scaling = rope_from_hf(hf)
  heads = hf["num_attention_heads"]
  mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                  qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"], rope_interleave=bool(hf.get("rope_interleave", True)))
  return DeepSeekConfig(
      family="deepseek", attention_block="mla", vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], first_dense_layers=hf.get("first_k_dense_replace") or 0,
      num_heads=heads, num_kv_heads=heads, head_dim=hf["v_head_dim"], mlp_dim=hf["intermediate_size"],
      max_seq_len=hf["max_position_embeddings"], rope_theta=theta, rope_scaling=scaling,
      norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)), mla=mla,
      moe=moe_from_hf(hf))


def config_to_hf(cfg, dtype: str) -> dict:
  m, mla = cfg.moe, cfg.mla
  shared, rest = divmod(m.shared_mlp_dim, m.expert_mlp_dim)
  problems = {"model.attention_block": (cfg.attention_block, "mla"), "model.moe.router": (m.router, "sigmoid"),
              "model.qk_norm": (cfg.qk_norm, False), "model.moe.shared_mlp_dim % expert_mlp_dim": (rest, 0),
              "model.sliding_window": (cfg.sliding_window, None), "model.layer_pattern": (cfg.layer_pattern, ())}
  for key, (value, needed) in problems.items():
    if value != needed:
      raise ConfigError(f"{key}={value!r} has no Hugging Face deepseek_v3 equivalent (it needs {needed!r})")
  common = decoder_config_to_hf(cfg, dtype)
  for key in ("head_dim", "mlp_bias"):
    common.pop(key)
  return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
          "num_key_value_heads": cfg.num_heads, "moe_intermediate_size": m.expert_mlp_dim,
          "n_shared_experts": shared, "n_routed_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
          "routed_scaling_factor": m.routed_scale, "norm_topk_prob": m.normalize_weights,
          "n_group": m.num_groups, "topk_group": m.groups_per_token, "first_k_dense_replace": cfg.first_dense_layers,
          "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
          "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
          "rope_interleave": mla.rope_interleave, "num_nextn_predict_layers": 0}


MAPPING = HFMapping(model_types=("deepseek_v3",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                    top=TOP, layer=MLA + EXPERTS, dense_layer=MLA + LAYER[-3:])
