"""Hugging Face names for the `kimi_linear` family: transformers' KimiLinearForCausalLM (model
type kimi_linear) in the tensor names of Moonshot's checkpoints, which transformers also saves.

Latent-attention layers are DeepSeek-V3's (self_attn.q_proj, kv_a_proj_with_mqa, ...).
Kimi Delta Attention layers keep q, k, v and each one's short convolution apart
(q_conv1d, ...), the forget gate's low-rank pair (f_a_proj, f_b_proj) with dt_bias
[heads x dim] and A_log [1, 1, heads, 1], the output gate's (g_a_proj, g_b_proj) and o_norm.
Experts are `block_sparse_moe` with w1 (gate), w3 (up) and w2 (down) per expert, DeepSeek-V3's
router (gate.weight and its e_score_correction_bias, model state here) and shared experts.
The dense first layers' MLP is `mlp.*` in Moonshot's files and `block_sparse_moe.*` in what
transformers saves; import reads either, export writes Moonshot's, and transformers loads both.

The layer kinds come from HF's `layer_types`, or the checkpoints' `linear_attn_config`
(full_attn_layers and kda_layers, counted from 1), as transformers reads them."""

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.families.deepseek.hf import MLA, moe_from_hf
from jaxpar.models.families.kimi_linear.config import KDA, NOPE, KimiLinearConfig
from jaxpar.models.hf_layout import LAYER, TOP, check_values, expert_entries, repeating_prefix
from jaxpar.models.layer_pattern import layer_mixer, layer_options
from jaxpar.models.mla_config import MLAConfig
from jaxpar.models.registry import HFMapping

_KDA = tuple((("attn", p), f"self_attn.{p}_proj.weight", "heads_in") for p in "qkv") + tuple(
    (("attn", f"conv_{p}"), f"self_attn.{p}_conv1d.weight", "conv") for p in "qkv") + (
    (("attn", "b"), "self_attn.b_proj.weight", "transpose"),
    (("attn", "f_a"), "self_attn.f_a_proj.weight", "transpose"),
    (("attn", "f_b"), "self_attn.f_b_proj.weight", "heads_in"),
    (("attn", "g_a"), "self_attn.g_a_proj.weight", "transpose"),
    (("attn", "g_b"), "self_attn.g_b_proj.weight", "heads_in"),
    (("attn", "dt_bias"), "self_attn.dt_bias", "heads_bias"),
    (("attn", "a_log"), "self_attn.A_log", "per_head_4d"),
    (("attn", "norm", "scale"), "self_attn.o_norm.weight", "same"),
    (("attn", "o"), "self_attn.o_proj.weight", "heads_out"),
)
_NORMS = tuple(e for e in LAYER if e[0][0] in ("attn_norm", "mlp_norm"))
_DENSE_MLP = LAYER[-3:]
_EXPERTS = expert_entries("block_sparse_moe", "w1", "w3", "w2") + (
    (("mlp", "bias"), "block_sparse_moe.gate.e_score_correction_bias", "same"),  # model state
    (("mlp", "shared", "gate"), "block_sparse_moe.shared_experts.gate_proj.weight", "transpose"),
    (("mlp", "shared", "up"), "block_sparse_moe.shared_experts.up_proj.weight", "transpose"),
    (("mlp", "shared", "down"), "block_sparse_moe.shared_experts.down_proj.weight", "transpose"),
)
# Kimi's names for DeepSeek-V3's expert fields (transformers' attribute_map).
_DEEPSEEK_NAMES = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
                   "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
                   "num_expert_group": "n_group"}
# Kimi's default token ids: an export of a smaller vocabulary must not name ids it lacks
# (transformers builds its embedding with pad_token_id as the padding row).
_TOKEN_IDS = {"pad_token_id": 163839, "bos_token_id": 163584, "eos_token_id": 163586}


def _layer_types(hf: dict) -> list[str]:
  linear = hf.get("linear_attn_config") or {}
  if hf.get("layer_types"):
    return list(hf["layer_types"])
  layers = hf["num_hidden_layers"]
  if "full_attn_layers" in linear and "kda_layers" in linear:
    full = set(linear["full_attn_layers"])
    return ["full_attention" if i + 1 in full else "linear_attention" for i in range(layers)]
  return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]


def _first_dense_layers(hf: dict) -> int:
  kinds = hf.get("mlp_layer_types") or (
      ["dense"] * hf.get("first_k_dense_replace", 1) + ["sparse"] * hf["num_hidden_layers"])
  dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
  if "dense" in kinds[dense:]:
    raise ConfigError(f"kimi_linear with mlp_layer_types={kinds} is not supported: jaxpar keeps dense layers "
                      "only before the first MoE layer (first_k_dense_replace)")
  return min(dense, hf["num_hidden_layers"])


def config_from_hf(hf: dict) -> KimiLinearConfig:
  activations.from_hf(hf, "kimi_linear", ("silu",))
  if hf.get("attention_bias"):
    raise ConfigError("kimi_linear with attention_bias=true is not supported: jaxpar's MLA is bias-free")
  types = _layer_types(hf)
  unknown = set(types) - {"linear_attention", "full_attention"}
  if unknown:
    raise ConfigError(f"kimi_linear layer_types {sorted(unknown)} are not supported: jaxpar reads "
                      "linear_attention and full_attention")
  linear = hf.get("linear_attn_config") or {}
  heads = linear.get("num_heads", hf.get("linear_num_heads", 32))
  head_dim = linear.get("head_dim", hf.get("linear_head_dim", 128))
  mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                  qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"])
  return KimiLinearConfig(
      vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      first_dense_layers=_first_dense_layers(hf), num_heads=hf["num_attention_heads"],
      num_kv_heads=hf["num_attention_heads"], head_dim=hf["v_head_dim"], mlp_dim=hf["intermediate_size"],
      max_seq_len=hf.get("model_max_length") or hf.get("max_position_embeddings", 1048576),
      norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      layer_pattern=[KDA if t == "linear_attention" else NOPE for t in repeating_prefix(types)],
      gated_deltanet={"num_key_heads": heads, "num_value_heads": heads, "key_head_dim": head_dim,
                      "value_head_dim": head_dim, "conv_kernel": linear.get(
                          "short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)), "variant": "kimi"},
      mla=mla, moe=moe_from_hf({_DEEPSEEK_NAMES.get(key, key): value for key, value in hf.items()}))


def config_to_hf(cfg, dtype: str) -> dict:
  m, mla, g = cfg.moe, cfg.mla, cfg.gated_deltanet
  shared, rest = divmod(m.shared_mlp_dim, m.expert_mlp_dim)
  check_values(cfg, "kimi_linear", {
      "attention_block": "mla", "mlp": "moe", "qk_norm": False, "attention_bias": False, "sliding_window": None,
      "attn_logit_soft_cap": None, "final_logit_soft_cap": None, "norm_unit_offset": False,
      "attention_output_gate": False, "mlp_activation": "silu", "moe.router": "sigmoid", "moe.shared_gate": False,
      "moe.router_bias": False, "moe.expert_bias": False, "moe.activation": "silu", "gated_deltanet.variant": "kimi"})
  if rest:
    raise ConfigError(f"model.moe.shared_mlp_dim={m.shared_mlp_dim} has no Hugging Face kimi_linear equivalent: "
                      f"it needs a multiple of model.moe.expert_mlp_dim={m.expert_mlp_dim}")
  mixers = [layer_mixer(cfg, i) for i in range(cfg.num_layers)]
  if set(mixers) - {"gated_deltanet", "mla"}:
    raise ConfigError(f"model.layer_pattern mixers {sorted(set(mixers))}: Hugging Face kimi_linear takes "
                      "gated_deltanet and mla layers only")
  if any(layer_options(cfg, i).rope for i, mixer in enumerate(mixers) if mixer == "mla"):
    raise ConfigError("a model.layer_pattern attention entry with rotary embeddings has no Hugging Face "
                      "kimi_linear equivalent (its latent attention has no positions): give it rope: false")
  full = [i + 1 for i, mixer in enumerate(mixers) if mixer == "mla"]
  kda = [i + 1 for i, mixer in enumerate(mixers) if mixer == "gated_deltanet"]
  ids = {key: None for key, value in _TOKEN_IDS.items() if value >= cfg.vocab_size}
  return {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.embed_dim, "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
          "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads, "hidden_act": "silu",
          "model_max_length": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
          "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
          "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
          "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
          "num_experts": m.num_experts, "num_experts_per_token": m.experts_per_token,
          "moe_intermediate_size": m.expert_mlp_dim, "num_shared_experts": shared,
          "routed_scaling_factor": m.routed_scale, "moe_renormalize": m.normalize_weights,
          "num_expert_group": m.num_groups, "topk_group": m.groups_per_token,
          "first_k_dense_replace": cfg.first_dense_layers,
          "mlp_layer_types": ["dense" if i < cfg.first_dense_layers else "sparse" for i in range(cfg.num_layers)],
          "layer_types": ["full_attention" if mixer == "mla" else "linear_attention" for mixer in mixers],
          "linear_attn_config": {"num_heads": g.num_value_heads, "head_dim": g.value_head_dim,
                                 "short_conv_kernel_size": g.conv_kernel, "full_attn_layers": full,
                                 "kda_layers": kda},
          **ids, "torch_dtype": dtype}


MAPPING = HFMapping(model_types=("kimi_linear",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                    top=TOP, layer=MLA + _EXPERTS, dense_layer=MLA + _DENSE_MLP,
                    groups=(("gated_deltanet_layers", _KDA + _NORMS + _EXPERTS),
                            ("gated_deltanet_dense_layers", _KDA + _NORMS + _DENSE_MLP)),
                    alternative_names=(("mlp.", "block_sparse_moe."),))
