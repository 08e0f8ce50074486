"""Hugging Face names for the `llama` family: Llama 2/3 (rope scaling), Mistral (sliding
window), Qwen2/2.5 (q/k/v biases), Qwen3 (qk-norm). Our RoPE rotates the two halves of
head_dim like HF, so q/k need no permutation. The conversion machinery is
jaxpar/convert/hf.py."""

import math

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.config import ModelConfig
from jaxpar.models.layer_pattern import Rope, layer_options
from jaxpar.models.registry import HFMapping

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
# HF model types whose `layer_types` mixes sliding and full layers.
_LAYER_TYPES = ("qwen2", "qwen3", "gpt_oss")

# (our path inside a layer, HF name after `model.layers.{i}.`, layout); absent entries are
# skipped. The attention and norm entries are shared with the MoE families (moe_hf.py).
ATTENTION = (
  (("attn", "q"), "self_attn.q_proj.weight", "heads_in"),
  (("attn", "k"), "self_attn.k_proj.weight", "heads_in"),
  (("attn", "v"), "self_attn.v_proj.weight", "heads_in"),
  (("attn", "o"), "self_attn.o_proj.weight", "heads_out"),
  (("attn", "q_bias"), "self_attn.q_proj.bias", "heads_bias"),
  (("attn", "k_bias"), "self_attn.k_proj.bias", "heads_bias"),
  (("attn", "v_bias"), "self_attn.v_proj.bias", "heads_bias"),
  (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", "same"),
  (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", "same"),
  (("attn_norm", "scale"), "input_layernorm.weight", "same"),
  (("mlp_norm", "scale"), "post_attention_layernorm.weight", "same"),
)
LAYER = ATTENTION + (
  (("mlp", "gate"), "mlp.gate_proj.weight", "transpose"),
  (("mlp", "up"), "mlp.up_proj.weight", "transpose"),
  (("mlp", "down"), "mlp.down_proj.weight", "transpose"),
)
TOP = (
  (("embed",), "model.embed_tokens.weight", "same"),
  (("final_norm", "scale"), "model.norm.weight", "same"),
  (("unembed",), "lm_head.weight", "transpose"),
)


def rope_from_hf(hf: dict) -> tuple[float, dict | None]:
  """(theta, our rope_scaling) from legacy `rope_theta`/`rope_scaling` or v5 `rope_parameters`."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return theta, None
  if kind == "linear":
    return theta, {"rope_type": "linear", "factor": params["factor"]}
  if kind == "yarn":
    factor, attention_factor = params["factor"], params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim") or 0.0
    if attention_factor is None and mscale and mscale_all_dim and factor > 1:  # as transformers infers it
      attention_factor = (0.1 * mscale * math.log(factor) + 1) / (0.1 * mscale_all_dim * math.log(factor) + 1)
    return theta, {"rope_type": "yarn", "factor": factor, "beta_fast": params.get("beta_fast") or 32.0,
                   "beta_slow": params.get("beta_slow") or 1.0, "truncate": params.get("truncate", True),
                   "original_max_position": params.get("original_max_position_embeddings",
                                                       hf.get("max_position_embeddings")),
                   "attention_factor": attention_factor,
                   **({"mscale_all_dim": mscale_all_dim} if mscale_all_dim else {})}
  if kind != "llama3":
    raise ConfigError(f"rope type {kind!r} is not supported: jaxpar implements default, linear, llama3 and "
                      "yarn RoPE")
  return theta, {"factor": params["factor"], "low_freq_factor": params["low_freq_factor"],
                 "high_freq_factor": params["high_freq_factor"],
                 "original_max_position": params["original_max_position_embeddings"]}


def config_from_hf(hf: dict) -> ModelConfig:
  kind = hf["model_type"]
  activations.from_hf(hf, kind, ("silu",))
  if hf.get("mlp_bias"):
    raise ConfigError(f"{kind} with mlp_bias={hf.get('mlp_bias')} is not supported: jaxpar's MLP is bias-free")
  if kind in ("llama", "mistral", "qwen3") and hf.get("attention_bias"):
    raise ConfigError(f"{kind} with attention_bias=true (o_proj bias too) is not supported")
  heads = hf["num_attention_heads"]
  theta, scaling = rope_from_hf(hf)
  return ModelConfig(**{"max_seq_len": hf["max_position_embeddings"], **windows_from_hf(hf)},
      family="llama", vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=theta, rope_scaling=scaling, norm_eps=hf["rms_norm_eps"],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=kind == "qwen3",
      attention_bias=kind == "qwen2")


def windows_from_hf(hf: dict) -> dict:
  """Our sliding-window fields from HF's: `sliding_window` when every layer slides (Mistral,
  Mixtral, Qwen with use_sliding_window), a `layer_pattern` when HF's `layer_types` repeat.
  Qwen's `max_window_layers` (full layers first, then sliding ones) does not repeat: then
  max_seq_len is cut to the window, where every layer sees everything (exact)."""
  window, kind = hf.get("sliding_window"), hf["model_type"]
  if not window or (kind not in ("mistral", "mixtral") and not hf.get("use_sliding_window")):
    return {}
  layers = hf["num_hidden_layers"]
  types = hf.get("layer_types")
  if types is None and "max_window_layers" in hf:
    types = ["sliding_attention" if i >= hf["max_window_layers"] else "full_attention" for i in range(layers)]
  sliding = [t == "sliding_attention" for t in types or ["sliding_attention"] * layers]
  if not any(sliding):
    return {}
  if all(sliding):
    return {"sliding_window": window}
  period = next(p for p in range(1, layers + 1) if layers % p == 0 and sliding == sliding[:p] * (layers // p))
  if period < layers:
    return {"layer_pattern": [{"sliding_window": window} if s else {} for s in sliding[:period]]}
  return {"max_seq_len": min(hf["max_position_embeddings"], window)}


def windows_to_hf(cfg: ModelConfig, model_type: str) -> dict:
  """HF's sliding-window fields for our model; a one-line ConfigError for what `model_type`
  cannot say (per-layer RoPE, soft-capping, several window sizes, mixed layers in Mistral)."""
  options = [layer_options(cfg, i) for i in range(cfg.num_layers)]
  if any(o.rope != Rope(cfg.rope_theta, cfg.rope_scaling) or o.attention.logit_soft_cap for o in options):
    raise ConfigError(f"model.layer_pattern={[k.model_dump() for k in cfg.layer_pattern]} / "
                      f"model.attn_logit_soft_cap={cfg.attn_logit_soft_cap}: per-layer RoPE and logit "
                      f"soft-capping have no Hugging Face {model_type} equivalent; export a model without them")
  windows = [o.attention.sliding_window for o in options]
  sizes = sorted(set(windows) - {None})
  if not sizes:
    return {}
  if len(sizes) > 1:
    raise ConfigError(f"model.layer_pattern has sliding windows {sizes}: Hugging Face {model_type} takes one "
                      "sliding_window; use one size")
  fields = {"sliding_window": sizes[0]}
  if model_type.startswith("qwen"):  # Qwen reads sliding_window only with this flag
    fields["use_sliding_window"] = True
  if model_type in _LAYER_TYPES:
    fields.update(max_window_layers=0,
                  layer_types=["full_attention" if w is None else "sliding_attention" for w in windows])
  elif None in windows:
    raise ConfigError(f"model.layer_pattern mixes sliding and full layers, which Hugging Face {model_type} "
                      "cannot say: give every layer the window, or none")
  return fields


def rope_scaling_to_hf(s) -> dict:
  """HF's rope_scaling dict for our RopeScaling."""
  if s.rope_type == "linear":
    return {"rope_type": "linear", "factor": s.factor}
  if s.rope_type == "yarn":
    yarn = {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
            "truncate": s.truncate, "original_max_position_embeddings": s.original_max_position,
            **({"mscale_all_dim": s.mscale_all_dim} if s.mscale_all_dim else {})}
    return yarn if s.attention_factor is None else {**yarn, "attention_factor": s.attention_factor}
  return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
          "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
  kind = "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"
  if cfg.mlp != "dense":
    raise ConfigError(f"model.mlp={cfg.mlp!r} has no Hugging Face architecture in the llama family")
  if kind == "llama" and any(layer_options(cfg, i).attention.sliding_window for i in range(cfg.num_layers)):
    kind = "mistral"  # Llama with a sliding window
  return {"architectures": [ARCHITECTURES[kind]], "model_type": kind, **decoder_config_to_hf(cfg, dtype),
          **windows_to_hf(cfg, kind)}


def decoder_config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
  """The HF config fields every decoder family here shares (no model type)."""
  if cfg.qk_norm and cfg.attention_bias:
    raise ConfigError("model.qk_norm with model.attention_bias has no Hugging Face architecture")
  scaling = cfg.rope_scaling and rope_scaling_to_hf(cfg.rope_scaling)
  return {
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": activations.hf_name(cfg.mlp_activation),
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "torch_dtype": dtype}


MAPPING = HFMapping(model_types=MODEL_TYPES, config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                    top=TOP, layer=LAYER)
