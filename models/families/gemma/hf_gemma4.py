"""Hugging Face names for Gemma 4 (text): Gemma4ForCausalLM, model type gemma4_text; and
the text model of a multimodal checkpoint (Gemma4ForConditionalGeneration, model type
gemma4: the published ones), whose vision and audio towers are left out. Export writes the
text model, gemma4_text.

Gemma 3's tensors (sandwich norms, Llama's projections, q/k norms), plus each layer's
`layer_scalar` and per-layer input block, and the model's per-layer embedding. HF's
`layer_types` become a pattern whose full-attention entries are the `gemma4_global` mixer;
their head width and KV heads come from HF's `per_layer_config` (what transformers writes)
or `global_head_dim` / `num_global_key_value_heads` (what the published configs say).
With `enable_moe_block`, each layer's experts and router beside the MLP (the experts'
gate and up projections are one tensor's halves). The last `num_kv_shared_layers` layers reuse
the keys and values of the last earlier layer of their type: the `gemma4_shared` and
`gemma4_global_shared` mixers (their tensors are q, q_norm and o only). What jaxpar does not
build yet (bidirectional attention) is a one-line error at import.
"""

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.families.gemma.config import Gemma4Config
from jaxpar.models.families.gemma.hf import _LAYER, _ropes
from jaxpar.models.hf_layout import TOP, repeating_prefix, rope_scaling_to_hf
from jaxpar.models.layer_pattern import layer_mixer, layer_options
from jaxpar.models.moe_config import MoEConfig
from jaxpar.models.registry import HFMapping

GLOBAL = "gemma4_global"
_EXPERTS = (
    (("experts", "router"), "router.proj.weight", "transpose"),
    (("experts", "router_scale"), "router.scale", "same"),
    (("experts", "expert_scale"), "router.per_expert_scale", "same"),
    (("experts", "gate"), "experts.gate_up_proj", "first_half_rows"),
    (("experts", "up"), "experts.gate_up_proj", "second_half_rows"),
    (("experts", "down"), "experts.down_proj", "swap_last"),
    (("mlp_post_norm_1", "scale"), "post_feedforward_layernorm_1.weight", "same"),
    (("experts_norm", "scale"), "pre_feedforward_layernorm_2.weight", "same"),
    (("experts_post_norm", "scale"), "post_feedforward_layernorm_2.weight", "same"),
)
_LAYER4 = _LAYER + (
    (("layer_scalar",), "layer_scalar", "same"),
    (("input_gate",), "per_layer_input_gate.weight", "transpose"),
    (("input_up",), "per_layer_projection.weight", "transpose"),
    (("input_norm", "scale"), "post_per_layer_input_norm.weight", "same"),
) + _EXPERTS
_TOP4 = TOP + (
    (("per_layer_inputs", "table"), "model.embed_tokens_per_layer.weight", "same"),
    (("per_layer_inputs", "projection"), "model.per_layer_model_projection.weight", "transpose"),
    (("per_layer_inputs", "norm", "scale"), "model.per_layer_projection_norm.weight", "same"),
)
# HF keys whose other values jaxpar cannot build yet, with what it would take.
_UNSUPPORTED = {
    "use_bidirectional_attention": (None, "bidirectional attention"),
    "attention_bias": (False, "attention biases"),
}


def _global_heads(hf: dict, types: list[str]) -> dict:
  """The global layers' head width and KV heads, as transformers writes them or as the
  published configs say them."""
  per_layer = hf.get("per_layer_config") or {}
  full = [str(i) for i, t in enumerate(types) if t == "full_attention"]
  given = per_layer.get(full[0], {}) if full else {}
  return {"global_head_dim": given.get("head_dim", hf.get("global_head_dim", hf["head_dim"])),
          "global_kv_heads": given.get("num_key_value_heads", hf.get("num_global_key_value_heads"))}


def config_from_hf(hf: dict) -> Gemma4Config:
  if hf["model_type"] == "gemma4":  # a multimodal checkpoint (Gemma4ForConditionalGeneration): its text model
    text = hf["text_config"]
    hf = {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))}
  kind = hf["model_type"]
  activations.from_hf(hf, kind, ("gelu_tanh",))
  for key, (default, what) in _UNSUPPORTED.items():
    if (hf.get(key) or default) != default:
      raise ConfigError(f"{kind} with {key}={hf[key]!r} is not supported yet: jaxpar does not build {what}")
  layers = hf["num_hidden_layers"]
  types = hf.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                    for i in range(layers)]
  (theta, scaling), (local_theta, local_scaling) = _ropes(hf)
  local = {"sliding_window": hf["sliding_window"], "rope_theta": local_theta, "rope_scaling": local_scaling}
  heads = _global_heads(hf, types)
  shared = hf.get("num_kv_shared_layers") or 0  # the last layers reuse the last earlier one's of their type
  mixers = [("gemma4" if t == "sliding_attention" else GLOBAL) + ("_shared" if i >= layers - shared else "")
            for i, t in enumerate(types)]
  kind = lambda mixer: {**({} if mixer.startswith(GLOBAL) else local),  # noqa: E731
                        **({} if mixer == "gemma4" else {"mixer": mixer})}
  return Gemma4Config(
      max_seq_len=hf["max_position_embeddings"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      num_layers=layers, num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
      head_dim=hf["head_dim"], mlp_dim=hf["intermediate_size"], rope_theta=theta, rope_scaling=scaling,
      norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      layer_pattern=[kind(m) for m in repeating_prefix(mixers)], double_wide_mlp=bool(hf.get("use_double_wide_mlp")),
      final_logit_soft_cap=hf.get("final_logit_softcapping"), keys_as_values=bool(hf.get("attention_k_eq_v")),
      per_layer_input_dim=hf.get("hidden_size_per_layer_input") or 0,
      per_layer_vocab_size=hf.get("vocab_size_per_layer_input") if hf.get("hidden_size_per_layer_input") else None,
      moe=_moe_from_hf(hf), **heads)


def _moe_from_hf(hf: dict) -> MoEConfig | None:
  """The experts beside the MLP: a softmax router whose top-k weights sum to 1, no
  auxiliary losses (the HF model trains none)."""
  if not hf.get("enable_moe_block"):
    return None
  return MoEConfig(num_experts=hf["num_experts"], experts_per_token=hf["top_k_experts"],
                   expert_mlp_dim=hf["moe_intermediate_size"], activation="gelu_tanh", normalize_weights=True,
                   balance_loss=0.0, router_z_loss=0.0)


def _rope_to_hf(rope) -> dict:
  return {"rope_theta": rope.theta, **(rope_scaling_to_hf(rope.scaling) if rope.scaling else {"rope_type": "default"})}


def config_to_hf(cfg: Gemma4Config, dtype: str) -> dict:
  """Gemma 4's config.json; a one-line ConfigError for what it cannot say."""
  options = [layer_options(cfg, i) for i in range(cfg.num_layers)]
  mixers = [layer_mixer(cfg, i) for i in range(cfg.num_layers)]
  is_global = [m.startswith(GLOBAL) for m in mixers]
  shared = sum(m.endswith("_shared") for m in mixers)
  if any(m.endswith("_shared") for m in mixers[:cfg.num_layers - shared]):
    raise ConfigError("model.layer_pattern: Hugging Face gemma4_text shares keys and values in its last layers only "
                      "(num_kv_shared_layers): put every gemma4_shared / gemma4_global_shared layer after the others")
  windows = {o.attention.sliding_window for o, g in zip(options, is_global) if not g}
  ropes = {g: o.rope for o, g in zip(options, is_global)}
  if (None in windows or len(windows) > 1 or any(o.attention.sliding_window for o, g in zip(options, is_global) if g)
      or any(o.rope != ropes[g] or o.rope is None for o, g in zip(options, is_global))):
    raise ConfigError("model.layer_pattern: Hugging Face gemma4_text takes one window on its gemma4 (sliding) "
                      "layers, none on its gemma4_global layers, and one RoPE per layer type")
  if (cfg.mlp != "dense" or cfg.attention_bias or cfg.mlp_activation != "gelu_tanh" or cfg.norm_unit_offset
      or cfg.query_pre_attn_scalar != 1 or cfg.attn_logit_soft_cap is not None):
    raise ConfigError("model.family=gemma4 exports only with the dense GeGLU MLP, norms without a unit offset, "
                      "unscaled and uncapped attention scores and no attention bias")
  global_kv = cfg.global_kv_heads or cfg.num_kv_heads
  if global_kv != cfg.num_kv_heads and not cfg.keys_as_values:
    raise ConfigError(f"model.global_kv_heads={global_kv} differs from num_kv_heads={cfg.num_kv_heads}, which "
                      "Hugging Face gemma4_text says only with keys_as_values (attention_k_eq_v)")
  types = ["full_attention" if g else "sliding_attention" for g in is_global]
  per_layer = {"head_dim": cfg.global_head_dim, **({"num_key_value_heads": global_kv} if cfg.keys_as_values else {})}
  return {
      "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "per_layer_config": {str(i): per_layer for i, g in enumerate(is_global) if g},
      "attention_k_eq_v": cfg.keys_as_values, "hidden_activation": "gelu_pytorch_tanh",
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "rope_parameters": {"full_attention": _rope_to_hf(ropes.get(True, options[0].rope)),
                          "sliding_attention": _rope_to_hf(ropes.get(False, options[0].rope))},
      "tie_word_embeddings": cfg.tie_embeddings, "sliding_window": min(windows) if windows else cfg.max_seq_len,
      "layer_types": types, "final_logit_softcapping": cfg.final_logit_soft_cap,
      "hidden_size_per_layer_input": cfg.per_layer_input_dim,
      "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
      "num_kv_shared_layers": shared, "use_double_wide_mlp": cfg.double_wide_mlp, "attention_bias": False, "torch_dtype": dtype, **_moe_to_hf(cfg.moe)}


def _moe_to_hf(m: MoEConfig | None) -> dict:
  if m is None:
    return {"enable_moe_block": False}
  if (m.router, m.normalize_weights, m.routed_scale, m.activation, m.shared_mlp_dim, m.num_groups,
      m.router_bias, m.expert_bias) != ("softmax", True, 1.0, "gelu_tanh", 0, 1, False, False):
    raise ConfigError("model.moe: Hugging Face gemma4_text's experts take a softmax router with normalised top-k "
                      "weights, GeGLU experts and nothing else (no shared expert, groups, biases or scale)")
  return {"enable_moe_block": True, "num_experts": m.num_experts, "top_k_experts": m.experts_per_token,
          "moe_intermediate_size": m.expert_mlp_dim}


# The multimodal checkpoints keep the text model's tensors under model.language_model.
GEMMA4 = HFMapping(model_types=("gemma4_text", "gemma4"), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                   top=_TOP4, layer=_LAYER4, groups=((f"{GLOBAL}_layers", _LAYER4),),
                   alternative_names=(("model.", "model.language_model."),))
