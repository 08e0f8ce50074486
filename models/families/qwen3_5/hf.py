"""Hugging Face names for the `qwen3_5` family: Qwen3_5ForCausalLM (model type qwen3_5_text).

Full-attention layers are Llama's layout plus the output gate, which HF keeps in q_proj
(per head: the query rows, then the gate's). Linear-attention layers (`linear_attn`) keep
q, k and v in one in_proj_qkv and one depthwise conv1d over the three; we keep each apart
(`Rows` parts). HF's `layer_types` become the `layer_pattern` (its shortest repeating
prefix, or the whole list)."""

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.families.qwen3_5.config import LINEAR, Qwen35Config
from jaxpar.models.hf_layout import LAYER, TOP, Rows, check_values, repeating_prefix, rope_from_hf
from jaxpar.models.layer_pattern import layer_mixer
from jaxpar.models.registry import HFMapping

_QKV = (("attn", "q"), ("attn", "k"), ("attn", "v"))
_CONV = (("attn", "conv_q"), ("attn", "conv_k"), ("attn", "conv_v"))
_GATED_Q = (("attn", "q"), ("attn", "gate"))
_per_head = lambda cfg: cfg.num_heads  # noqa: E731

_ATTENTION_LAYER = tuple(
    (path, name, Rows("heads_in", _GATED_Q.index(path), _GATED_Q, _per_head) if path in _GATED_Q else layout)
    for path, name, layout in LAYER) + (
    (("attn", "gate"), "self_attn.q_proj.weight", Rows("heads_in", 1, _GATED_Q, _per_head)),)
_LINEAR_LAYER = tuple(e for e in LAYER if e[0][0] != "attn") + tuple(
    (path, "linear_attn.in_proj_qkv.weight", Rows("heads_in", i, _QKV)) for i, path in enumerate(_QKV)) + tuple(
    (path, "linear_attn.conv1d.weight", Rows("conv", i, _CONV)) for i, path in enumerate(_CONV)) + (
    (("attn", "z"), "linear_attn.in_proj_z.weight", "heads_in"),
    (("attn", "b"), "linear_attn.in_proj_b.weight", "transpose"),
    (("attn", "a"), "linear_attn.in_proj_a.weight", "transpose"),
    (("attn", "a_log"), "linear_attn.A_log", "same"),
    (("attn", "dt_bias"), "linear_attn.dt_bias", "same"),
    (("attn", "norm", "scale"), "linear_attn.norm.weight", "same"),
    (("attn", "o"), "linear_attn.out_proj.weight", "heads_out"),
)
_TYPES = {"linear_attention": "gated_deltanet", "full_attention": "gqa"}
EXPORTABLE = {"attention_block": "gqa", "attention_output_gate": True, "qk_norm": True, "norm_unit_offset": True,
              "attention_bias": False, "mlp": "dense", "mlp_activation": "silu", "first_dense_layers": 0,
              "rope_scaling": None, "sliding_window": None, "attn_logit_soft_cap": None,
              "final_logit_soft_cap": None, "attention_sinks": False, "query_pre_attn_scalar": None,
              "scale_embeddings": False}


def config_from_hf(hf: dict) -> Qwen35Config:
  activations.from_hf(hf, hf["model_type"], ("silu",))
  if hf.get("attention_bias"):
    raise ConfigError("qwen3_5_text with attention_bias=true is not supported")
  layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
  types = hf.get("layer_types") or [
      "linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else "full_attention" for i in range(layers)]
  unknown = set(types) - set(_TYPES)
  if unknown:
    raise ConfigError(f"qwen3_5_text layer_types {sorted(unknown)} are not supported: jaxpar reads {sorted(_TYPES)}")
  theta, scaling = rope_from_hf(hf)
  rope = hf.get("rope_parameters") or {}
  return Qwen35Config(
      max_seq_len=hf["max_position_embeddings"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, mlp_dim=hf["intermediate_size"],
      rope_theta=theta, rope_scaling=scaling,
      rope_fraction=rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)),
      norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      layer_pattern=[LINEAR if t == "linear_attention" else {} for t in repeating_prefix(types)],
      gated_deltanet={"num_key_heads": hf["linear_num_key_heads"], "num_value_heads": hf["linear_num_value_heads"],
                      "key_head_dim": hf["linear_key_head_dim"], "value_head_dim": hf["linear_value_head_dim"],
                      "conv_kernel": hf["linear_conv_kernel_dim"]})


def config_to_hf(cfg, dtype: str) -> dict:
  check_values(cfg, "qwen3_5_text", EXPORTABLE)
  mixers = [layer_mixer(cfg, i) for i in range(cfg.num_layers)]
  if set(mixers) - set(_TYPES.values()):
    raise ConfigError(f"model.layer_pattern mixers {sorted(set(mixers))}: Hugging Face qwen3_5_text takes "
                      "gated_deltanet and gqa layers only")
  g = cfg.gated_deltanet
  return {
      "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                          "partial_rotary_factor": cfg.rope_fraction},
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
      "layer_types": ["linear_attention" if m == "gated_deltanet" else "full_attention" for m in mixers],
      "linear_num_key_heads": g.num_key_heads, "linear_num_value_heads": g.num_value_heads,
      "linear_key_head_dim": g.key_head_dim, "linear_value_head_dim": g.value_head_dim,
      "linear_conv_kernel_dim": g.conv_kernel, "torch_dtype": dtype}


MAPPING = HFMapping(model_types=("qwen3_5_text",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                    top=TOP, layer=_ATTENTION_LAYER, groups=(("gated_deltanet_layers", _LINEAR_LAYER),))
