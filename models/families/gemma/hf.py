"""Hugging Face names for the Gemma families: `gemma2` (Gemma2ForCausalLM) and `gemma3`
(Gemma3ForCausalLM, model type gemma3_text). Gemma's norms store (scale - 1) and our
`norm_unit_offset` norms do too, so every tensor maps as it is (projections as in Llama);
`layer_types` become a `layer_pattern` (with Gemma 3's local RoPE on its sliding entries)."""

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.config import ModelConfig
from jaxpar.models.families.gemma.config import Gemma2Config, Gemma3Config
from jaxpar.models.hf_layout import LAYER, TOP, repeating_prefix, rope_from_hf
from jaxpar.models.layer_pattern import Rope, layer_options
from jaxpar.models.registry import HFMapping

_NORMS = (
  (("attn_norm", "scale"), "input_layernorm.weight", "same"),
  (("attn_post_norm", "scale"), "post_attention_layernorm.weight", "same"),
  (("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", "same"),
  (("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight", "same"),
)
# Llama's projections and q/k norms, Gemma's four layer norms.
_LAYER = tuple(e for e in LAYER if e[0][0] in ("attn", "mlp") and e[2] != "heads_bias") + _NORMS


def _ropes(hf: dict) -> tuple[tuple, tuple]:
  """((theta, scaling) of global layers, of local layers) from v5 `rope_parameters` keyed by
  layer type, or legacy rope_theta / rope_scaling / rope_local_base_freq."""
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params:
    return (rope_from_hf({"rope_parameters": params["full_attention"]}),
            rope_from_hf({"rope_parameters": params.get("sliding_attention") or params["full_attention"]}))
  whole = rope_from_hf(hf)
  return whole, ((float(hf["rope_local_base_freq"]), None) if "rope_local_base_freq" in hf else whole)


def config_from_hf(hf: dict) -> ModelConfig:
  kind = hf["model_type"]
  activations.from_hf(hf, kind, ("gelu_tanh",))
  if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
    raise ConfigError(f"{kind} with attention_bias or use_bidirectional_attention is not supported")
  (theta, scaling), (local_theta, local_scaling) = _ropes(hf)
  layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
  types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
  local = {"sliding_window": hf["sliding_window"]}
  if kind == "gemma3_text":
    local.update(rope_theta=local_theta, rope_scaling=local_scaling)
  pattern = [local if t == "sliding_attention" else {} for t in repeating_prefix(types)]
  return (Gemma3Config if kind == "gemma3_text" else Gemma2Config)(
      max_seq_len=hf["max_position_embeddings"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=theta, rope_scaling=scaling, norm_eps=hf["rms_norm_eps"], layer_pattern=pattern,
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)), qk_norm=kind == "gemma3_text",
      attn_logit_soft_cap=hf.get("attn_logit_softcapping"), final_logit_soft_cap=hf.get("final_logit_softcapping"),
      query_pre_attn_scalar=hf["query_pre_attn_scalar"])


def _rope_to_hf(rope: Rope) -> dict:
  scaling = rope.scaling
  if scaling is None:
    return {"rope_type": "default", "rope_theta": rope.theta}
  if scaling.rope_type != "linear":
    raise ConfigError(f"model.rope_scaling.rope_type={scaling.rope_type!r}: Gemma takes linear scaling only")
  return {"rope_type": "linear", "factor": scaling.factor, "rope_theta": rope.theta}


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
  """Gemma 2 or 3's config.json; a one-line ConfigError for what it cannot say (several
  window sizes, RoPE other than one per layer type)."""
  kind = "gemma3_text" if cfg.family == "gemma3" else "gemma2"
  options = [layer_options(cfg, i) for i in range(cfg.num_layers)]
  windows = {o.attention.sliding_window for o in options} - {None}
  ropes = {o.attention.sliding_window is not None: o.rope for o in options}
  caps = {o.attention.logit_soft_cap for o in options}
  if len(windows) > 1 or len(caps) > 1 or any(
      o.rope != ropes[o.attention.sliding_window is not None] or o.rope is None for o in options):
    raise ConfigError(f"model.layer_pattern={[k.model_dump() for k in cfg.layer_pattern]}: Hugging Face {kind} "
                      "takes one window, one soft cap and one RoPE per layer type (sliding, full)")
  if kind == "gemma2" and len(set(ropes.values())) > 1:
    raise ConfigError("model.layer_pattern gives sliding layers their own RoPE, which gemma2 cannot say: "
                      "use family gemma3")
  if cfg.mlp != "dense" or cfg.attention_bias or cfg.mlp_activation != "gelu_tanh" or not cfg.norm_unit_offset:
    raise ConfigError(f"model.family={cfg.family} exports as {kind} only with the dense GeGLU MLP, "
                      "norm_unit_offset and no attention bias")
  full = ropes.get(False) or Rope(cfg.rope_theta, cfg.rope_scaling)
  rope = ({"full_attention": _rope_to_hf(full), "sliding_attention": _rope_to_hf(ropes.get(True) or full)}
          if kind == "gemma3_text" else _rope_to_hf(full))
  return {
      "architectures": ["Gemma3ForCausalLM" if kind == "gemma3_text" else "Gemma2ForCausalLM"],
      "model_type": kind, "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
      "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "hidden_activation": activations.hf_name(cfg.mlp_activation), "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.norm_eps, "rope_parameters": rope, "tie_word_embeddings": cfg.tie_embeddings,
      "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
      "sliding_window": min(windows) if windows else cfg.max_seq_len,
      "layer_types": ["full_attention" if o.attention.sliding_window is None else "sliding_attention"
                      for o in options],
      "attn_logit_softcapping": caps.pop(), "final_logit_softcapping": cfg.final_logit_soft_cap,
      "attention_bias": False, "torch_dtype": dtype}


def _mapping(model_type: str) -> HFMapping:
  return HFMapping(model_types=(model_type,), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                   top=TOP, layer=_LAYER)


GEMMA2, GEMMA3 = _mapping("gemma2"), _mapping("gemma3_text")
