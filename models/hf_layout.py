"""The Hugging Face names and config fields the decoder families share (each family's own
are in models/families/<name>/hf.py): Llama's attention, norm and MLP tensors, RoPE and
sliding-window fields both ways, the dense decoder's config, and experts stored one tensor
per expert. Our RoPE rotates the two halves of head_dim like HF, so q/k need no
permutation. The conversion machinery is jaxpar/convert/hf.py."""

import dataclasses
import functools
import math
from typing import Callable

from jaxpar.errors import ConfigError
from jaxpar.models import activations
from jaxpar.models.config import ModelConfig
from jaxpar.models.layer_pattern import Rope, layer_options
from jaxpar.models.moe_config import MoEConfig, MoEModelConfig

# HF model types whose `layer_types` mixes sliding and full layers.
_LAYER_TYPES = ("qwen2", "qwen3", "gpt_oss")

@dataclasses.dataclass(frozen=True)
class Rows:
  """The layout of one of several parameters that HF keeps in one tensor, stacked along its
  first axis: this is part `part` of `parts` (our paths inside the layer, in HF's order),
  each read in `layout`. `groups` (a function of the model config): the parts alternate in
  that many groups (Qwen3.5's gated q_proj: per head, the query rows then the gate's);
  None: one part after another (in_proj_qkv: q, then k, then v)."""
  layout: str
  part: int
  parts: tuple[tuple[str, ...], ...]
  groups: Callable | None = None


# (our path inside a layer, HF name after `model.layers.{i}.`, layout); absent entries are
# skipped.
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


def repeating_prefix(types: list[str]) -> list[str]:
  """The shortest prefix of HF's `layer_types` that, cycled, gives every layer's type: a
  `layer_pattern` (the whole list when nothing shorter repeats)."""
  return next(types[:p] for p in range(1, len(types) + 1)
              if all(t == types[i % p] for i, t in enumerate(types)))


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
  if kind == "proportional":
    return theta, {"rope_type": "proportional", "factor": params.get("factor", 1.0),
                   "fraction": params.get("partial_rotary_factor", 1.0)}
  if kind != "llama3":
    raise ConfigError(f"rope type {kind!r} is not supported: jaxpar implements default, linear, llama3, "
                      "yarn and proportional RoPE")
  return theta, {"factor": params["factor"], "low_freq_factor": params["low_freq_factor"],
                 "high_freq_factor": params["high_freq_factor"],
                 "original_max_position": params["original_max_position_embeddings"]}


def decoder_config_from_hf(hf: dict) -> ModelConfig:
  """A dense decoder's config from HF's, as model type llama, mistral, qwen2 or qwen3 says it."""
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
  if s.rope_type == "proportional":
    return {"rope_type": "proportional", "partial_rotary_factor": s.fraction, "factor": s.factor}
  return {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
          "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position}


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


def expert_entries(prefix: str, gate: str, up: str, down: str):
  """The router and experts of an MoE layer stored one tensor per expert (`{expert}`)."""
  return (
    (("mlp", "router"), f"{prefix}.gate.weight", "transpose"),
    (("mlp", "gate"), f"{prefix}.experts.{{expert}}.{gate}.weight", "transpose"),
    (("mlp", "up"), f"{prefix}.experts.{{expert}}.{up}.weight", "transpose"),
    (("mlp", "down"), f"{prefix}.experts.{{expert}}.{down}.weight", "transpose"),
  )


def moe_config_from_hf(hf: dict, *, family: str, attention_type: str, expert_mlp_dim: int,
                       normalize: bool) -> MoEModelConfig:
  """Our config from the dense decoder fields (read as `attention_type`) plus the MoE ones."""
  dense = decoder_config_from_hf({**hf, "model_type": attention_type})
  num_experts = hf.get("num_local_experts") or hf.get("num_experts")
  moe = MoEConfig(num_experts=num_experts, experts_per_token=hf["num_experts_per_tok"],
                  expert_mlp_dim=expert_mlp_dim, normalize_weights=normalize,
                  balance_loss=hf.get("router_aux_loss_coef", 0.01), router_z_loss=0.0)
  return MoEModelConfig(**dense.model_dump(exclude={"family", "mlp"}), family=family, moe=moe)


def check_values(cfg, kind: str, needed: dict):
  """A one-line ConfigError for the first `model.<key>` whose value Hugging Face `kind` cannot
  say (needed: {dotted key under model: the value it needs})."""
  for key, value_needed in needed.items():
    value = functools.reduce(getattr, key.split("."), cfg)
    if value != value_needed:
      raise ConfigError(f"model.{key}={value!r} has no Hugging Face {kind} equivalent (it needs {value_needed!r})")
