"""Hugging Face names for the `llama` family: Llama 2/3 (rope scaling), Mistral, Qwen2/2.5
(q/k/v biases), Qwen3 (qk-norm). Our RoPE rotates the two halves of head_dim like HF, so
q/k need no permutation. The conversion machinery is jaxpar/convert/hf.py."""

from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig
from jaxpar.models.registry import HFMapping

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

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
  if kind != "llama3":
    raise ConfigError(f"rope type {kind!r} is not supported: jaxpar implements default and llama3 RoPE")
  return theta, {"factor": params["factor"], "low_freq_factor": params["low_freq_factor"],
                 "high_freq_factor": params["high_freq_factor"],
                 "original_max_position": params["original_max_position_embeddings"]}


def config_from_hf(hf: dict) -> ModelConfig:
  kind = hf["model_type"]
  if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias"):
    raise ConfigError(f"{kind} with hidden_act={hf.get('hidden_act')!r}, mlp_bias={hf.get('mlp_bias')} "
                     "is not supported: jaxpar's MLP is bias-free SwiGLU (silu)")
  if kind in ("llama", "mistral", "qwen3") and hf.get("attention_bias"):
    raise ConfigError(f"{kind} with attention_bias=true (o_proj bias too) is not supported")
  heads = hf["num_attention_heads"]
  theta, scaling = rope_from_hf(hf)
  max_len = hf["max_position_embeddings"]
  window = hf.get("sliding_window")
  if window and (kind == "mistral" or hf.get("use_sliding_window")):
    # Exact within the window; jaxpar has no sliding-window attention to go beyond it.
    max_len = min(max_len, window)
  return ModelConfig(
      family="llama", vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      max_seq_len=max_len, rope_theta=theta, rope_scaling=scaling, norm_eps=hf["rms_norm_eps"],
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=kind == "qwen3",
      attention_bias=kind == "qwen2")


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
  kind = "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"
  if cfg.mlp != "dense":
    raise ConfigError(f"model.mlp={cfg.mlp!r} has no Hugging Face architecture in the llama family")
  return {"architectures": [ARCHITECTURES[kind]], "model_type": kind, **decoder_config_to_hf(cfg, dtype)}


def decoder_config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
  """The HF config fields every decoder family here shares (no model type)."""
  if cfg.qk_norm and cfg.attention_bias:
    raise ConfigError("model.qk_norm with model.attention_bias has no Hugging Face architecture")
  scaling = cfg.rope_scaling and {
      "rope_type": "llama3", "factor": cfg.rope_scaling.factor,
      "low_freq_factor": cfg.rope_scaling.low_freq_factor,
      "high_freq_factor": cfg.rope_scaling.high_freq_factor,
      "original_max_position_embeddings": cfg.rope_scaling.original_max_position}
  return {
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "torch_dtype": dtype}


MAPPING = HFMapping(model_types=MODEL_TYPES, config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                    top=TOP, layer=LAYER)
