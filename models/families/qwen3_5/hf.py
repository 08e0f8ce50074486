"""Hugging Face names for the Qwen3.5 hybrids: Qwen3_5ForCausalLM (model type qwen3_5_text),
Qwen3_5MoeForCausalLM (qwen3_5_moe_text) and Qwen3NextForCausalLM (qwen3_next).

Full-attention layers are Llama's layout plus the output gate, which HF keeps in q_proj
(per head: the query rows, then the gate's). Linear-attention layers (`linear_attn`) keep
q, k and v in one tensor and one depthwise conv1d over the three; we keep each apart
(`Rows` parts). Qwen3.5 stores them one after another (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a); Qwen3-Next groups them by key head (in_proj_qkvz: per key head its q, k, then
its value heads' v and z rows; in_proj_ba likewise). The MoE variants' experts are stored
one tensor per expert, beside a shared expert and its sigmoid gate. HF's `layer_types`
become the `layer_pattern` (its shortest repeating prefix, or the whole list)."""

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.families.qwen3_5.config import LINEAR, Qwen35Config, Qwen35MoeConfig, Qwen3NextConfig
from jaxpar.models.hf_layout import (ATTENTION, LAYER, TOP, Rows, check_values, expert_entries, repeating_prefix,
                                     rope_from_hf)
from jaxpar.models.layer_pattern import layer_mixer
from jaxpar.models.moe_config import MoEConfig
from jaxpar.models.registry import HFMapping

_GATED_Q = (("attn", "q"), ("attn", "gate"))
_QKV = (("attn", "q"), ("attn", "k"), ("attn", "v"))
_QKVZ = _QKV + (("attn", "z"),)
_BA = (("attn", "b"), ("attn", "a"))
_CONV = (("attn", "conv_q"), ("attn", "conv_k"), ("attn", "conv_v"))
_per_head = lambda cfg: cfg.num_heads  # noqa: E731
_per_key_head = lambda cfg: cfg.gated_deltanet.num_key_heads  # noqa: E731

_NORMS = tuple(e for e in LAYER if e[0][0] in ("attn_norm", "mlp_norm"))
_DENSE_MLP = tuple(e for e in LAYER if e[0][0] == "mlp")
_MOE_MLP = expert_entries("mlp", "gate_proj", "up_proj", "down_proj") + (
    (("mlp", "shared", "gate"), "mlp.shared_expert.gate_proj.weight", "transpose"),
    (("mlp", "shared", "up"), "mlp.shared_expert.up_proj.weight", "transpose"),
    (("mlp", "shared", "down"), "mlp.shared_expert.down_proj.weight", "transpose"),
    (("mlp", "shared_gate"), "mlp.shared_expert_gate.weight", "transpose"),
)
_GATED_ATTENTION = tuple(
    (path, name, Rows("heads_in", _GATED_Q.index(path), _GATED_Q, _per_head) if path in _GATED_Q else layout)
    for path, name, layout in ATTENTION if path[0] == "attn") + (
    (("attn", "gate"), "self_attn.q_proj.weight", Rows("heads_in", 1, _GATED_Q, _per_head)),)
_LINEAR_COMMON = tuple(
    (path, "linear_attn.conv1d.weight", Rows("conv", i, _CONV)) for i, path in enumerate(_CONV)) + (
    (("attn", "a_log"), "linear_attn.A_log", "same"),
    (("attn", "dt_bias"), "linear_attn.dt_bias", "same"),
    (("attn", "norm", "scale"), "linear_attn.norm.weight", "same"),
    (("attn", "o"), "linear_attn.out_proj.weight", "heads_out"),
)
_LINEAR_QWEN35 = _LINEAR_COMMON + tuple(
    (path, "linear_attn.in_proj_qkv.weight", Rows("heads_in", i, _QKV)) for i, path in enumerate(_QKV)) + (
    (("attn", "z"), "linear_attn.in_proj_z.weight", "heads_in"),
    (("attn", "b"), "linear_attn.in_proj_b.weight", "transpose"),
    (("attn", "a"), "linear_attn.in_proj_a.weight", "transpose"),
)
_LINEAR_QWEN3_NEXT = _LINEAR_COMMON + tuple(
    (path, "linear_attn.in_proj_qkvz.weight", Rows("heads_in", i, _QKVZ, _per_key_head))
    for i, path in enumerate(_QKVZ)) + tuple(
    (path, "linear_attn.in_proj_ba.weight", Rows("transpose", i, _BA, _per_key_head)) for i, path in enumerate(_BA))

_TYPES = {"linear_attention": "gated_deltanet", "full_attention": "gqa"}
# model type -> (HF class, our config class, linear layers' entries, whether MoE)
_KINDS = {
    "qwen3_5_text": ("Qwen3_5ForCausalLM", Qwen35Config, _LINEAR_QWEN35, False),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", Qwen35MoeConfig, _LINEAR_QWEN35, True),
    "qwen3_next": ("Qwen3NextForCausalLM", Qwen3NextConfig, _LINEAR_QWEN3_NEXT, True),
}
_FAMILY_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_next": "qwen3_next"}
EXPORTABLE = {"attention_block": "gqa", "attention_output_gate": True, "qk_norm": True, "norm_unit_offset": True,
              "attention_bias": False, "mlp_activation": "silu", "first_dense_layers": 0,
              "rope_scaling": None, "sliding_window": None, "attn_logit_soft_cap": None,
              "final_logit_soft_cap": None, "attention_sinks": False, "query_pre_attn_scalar": None,
              "scale_embeddings": False}
_MOE_EXPORTABLE = {"moe.router": "softmax", "moe.shared_gate": True, "moe.routed_scale": 1.0, "moe.num_groups": 1,
                   "moe.router_bias": False, "moe.expert_bias": False, "moe.activation": "silu"}


def _moe_from_hf(hf: dict, kind: str) -> dict:
  if kind == "qwen3_next" and (hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers")):
    raise ConfigError(f"qwen3_next with decoder_sparse_step={hf.get('decoder_sparse_step')}, mlp_only_layers="
                      f"{hf.get('mlp_only_layers')} is not supported: jaxpar's hybrids are all-MoE")
  return {"moe": MoEConfig(num_experts=hf["num_experts"], experts_per_token=hf["num_experts_per_tok"],
                           expert_mlp_dim=hf["moe_intermediate_size"],
                           shared_mlp_dim=hf["shared_expert_intermediate_size"], shared_gate=True,
                           normalize_weights=bool(hf.get("norm_topk_prob", True)),
                           balance_loss=hf.get("router_aux_loss_coef", 0.001), router_z_loss=0.0)}


def config_from_hf(hf: dict) -> Qwen35Config:
  kind = hf["model_type"]
  activations.from_hf(hf, kind, ("silu",))
  if hf.get("attention_bias"):
    raise ConfigError(f"{kind} with attention_bias=true is not supported")
  layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
  types = hf.get("layer_types") or [
      "linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else "full_attention" for i in range(layers)]
  unknown = set(types) - set(_TYPES)
  if unknown:
    raise ConfigError(f"{kind} layer_types {sorted(unknown)} are not supported: jaxpar reads {sorted(_TYPES)}")
  theta, scaling = rope_from_hf(hf)
  rope = hf.get("rope_parameters") or {}
  _, config_class, _, moe = _KINDS[kind]
  return config_class(
      max_seq_len=hf["max_position_embeddings"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
      num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf.get("intermediate_size") or hf["moe_intermediate_size"],
      rope_theta=theta, rope_scaling=scaling,
      rope_fraction=rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)),
      norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      layer_pattern=[LINEAR if t == "linear_attention" else {} for t in repeating_prefix(types)],
      gated_deltanet={"num_key_heads": hf["linear_num_key_heads"], "num_value_heads": hf["linear_num_value_heads"],
                      "key_head_dim": hf["linear_key_head_dim"], "value_head_dim": hf["linear_value_head_dim"],
                      "conv_kernel": hf["linear_conv_kernel_dim"]},
      **(_moe_from_hf(hf, kind) if moe else {}))


def config_to_hf(cfg, dtype: str) -> dict:
  kind = _FAMILY_TYPES[cfg.family]
  architecture, _, _, moe = _KINDS[kind]
  check_values(cfg, kind, {**EXPORTABLE, **(_MOE_EXPORTABLE if moe else {}), "mlp": "moe" if moe else "dense"})
  mixers = [layer_mixer(cfg, i) for i in range(cfg.num_layers)]
  if set(mixers) - set(_TYPES.values()):
    raise ConfigError(f"model.layer_pattern mixers {sorted(set(mixers))}: Hugging Face {kind} takes "
                      "gated_deltanet and gqa layers only")
  g = cfg.gated_deltanet
  fields = {
      "architectures": [architecture], "model_type": kind, "vocab_size": cfg.vocab_size,
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
  if moe:
    m = cfg.moe
    fields.update(num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
                  moe_intermediate_size=m.expert_mlp_dim, shared_expert_intermediate_size=m.shared_mlp_dim,
                  router_aux_loss_coef=m.balance_loss)
    if kind == "qwen3_next":
      fields.update(norm_topk_prob=m.normalize_weights, decoder_sparse_step=1, mlp_only_layers=[])
    elif not m.normalize_weights:
      raise ConfigError("model.moe.normalize_weights=false has no Hugging Face qwen3_5_moe_text equivalent "
                        "(it always normalises the top-k weights): use family qwen3_next")
  if kind == "qwen3_5_moe_text":
    fields.pop("intermediate_size")
  return fields


def _mapping(kind: str) -> HFMapping:
  _, _, linear, moe = _KINDS[kind]
  mlp = _MOE_MLP if moe else _DENSE_MLP
  return HFMapping(model_types=(kind,), config_from_hf=config_from_hf, config_to_hf=config_to_hf, top=TOP,
                   layer=_GATED_ATTENTION + _NORMS + mlp,
                   groups=(("gated_deltanet_layers", linear + _NORMS + mlp),))


QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT = (_mapping(kind) for kind in _KINDS)
