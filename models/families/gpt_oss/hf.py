"""Hugging Face names for the `gpt_oss` family: transformers' GptOss layout. Attention is
Llama's with biases on all four projections and a sink logit per head; the experts of a
layer are stored together: `gate_up_proj` [experts, embed, 2 x mlp] with the gate in the
even columns and up in the odd ones (the `even_columns` / `odd_columns` layouts of
jaxpar/convert/hf.py), `down_proj` [experts, mlp, embed] as ours, each with a bias; the
router is a biased linear layer."""

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.families.gpt_oss.config import GptOssConfig
from jaxpar.models.hf_layout import ATTENTION, TOP, check_values, rope_from_hf, rope_scaling_to_hf, windows_to_hf
from jaxpar.models.registry import HFMapping

LAYER = ATTENTION + (
  (("attn", "o_bias"), "self_attn.o_proj.bias", "same"),
  (("attn", "sinks"), "self_attn.sinks", "same"),
  (("mlp", "router"), "mlp.router.weight", "transpose"),
  (("mlp", "router_bias"), "mlp.router.bias", "same"),
  (("mlp", "gate"), "mlp.experts.gate_up_proj", "even_columns"),
  (("mlp", "up"), "mlp.experts.gate_up_proj", "odd_columns"),
  (("mlp", "gate_bias"), "mlp.experts.gate_up_proj_bias", "even_columns"),
  (("mlp", "up_bias"), "mlp.experts.gate_up_proj_bias", "odd_columns"),
  (("mlp", "down"), "mlp.experts.down_proj", "same"),
  (("mlp", "down_bias"), "mlp.experts.down_proj_bias", "same"),
)


def config_from_hf(hf: dict):
  activations.from_hf(hf, "gpt_oss", ("clamped_swiglu",))
  if not hf.get("attention_bias", True):
    raise ConfigError("gpt_oss with attention_bias=False is not supported: jaxpar's GPT-OSS has attention biases")
  theta, scaling = rope_from_hf(hf)
  heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
  types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
  period = next(p for p in range(1, layers + 1) if all(t == types[i % p] for i, t in enumerate(types)))
  pattern = [{"sliding_window": hf["sliding_window"]} if t == "sliding_attention" else {} for t in types[:period]]
  moe = dict(num_experts=hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
             expert_mlp_dim=hf["intermediate_size"], balance_loss=hf.get("router_aux_loss_coef", 0.001),
             swiglu_limit=hf.get("swiglu_limit", 7.0), swiglu_alpha=hf.get("swiglu_alpha", 1.702))
  return GptOssConfig(
      max_seq_len=hf["max_position_embeddings"], layer_pattern=pattern, vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"], num_layers=layers, num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"], rope_theta=theta, rope_scaling=scaling, norm_eps=hf["rms_norm_eps"],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe)


# What GptOss always has: the model section's values it needs.
_EXPORTABLE = {"moe.router": "softmax", "moe.normalize_weights": True, "moe.router_bias": True,
               "moe.expert_bias": True, "moe.activation": "clamped_swiglu", "moe.shared_mlp_dim": 0,
               "moe.routed_scale": 1.0, "moe.num_groups": 1, "first_dense_layers": 0, "attention_block": "gqa",
               "attention_bias": True, "attention_out_bias": True, "attention_sinks": True, "qk_norm": False}


def config_to_hf(cfg, dtype: str) -> dict:
  """GptOss's config.json; a one-line ConfigError for what it cannot say."""
  check_values(cfg, "gpt_oss", _EXPORTABLE)
  m = cfg.moe
  windows = windows_to_hf(cfg, "gpt_oss")
  scaling = cfg.rope_scaling and rope_scaling_to_hf(cfg.rope_scaling)
  return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.embed_dim, "intermediate_size": m.expert_mlp_dim, "num_hidden_layers": cfg.num_layers,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
          "hidden_act": activations.hf_name(cfg.moe.activation), "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
          "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
          "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": True,
          "num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
          "router_aux_loss_coef": m.balance_loss, "swiglu_limit": m.swiglu_limit, "swiglu_alpha": m.swiglu_alpha,
          "sliding_window": windows.get("sliding_window"),
          "layer_types": windows.get("layer_types", ["full_attention"] * cfg.num_layers), "torch_dtype": dtype}


MAPPING = HFMapping(model_types=("gpt_oss",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                    top=TOP, layer=LAYER)
