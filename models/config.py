"""The `model` section of a config: the architecture a family builds.

Plain pydantic (of jaxpar, only the activation table's names), so a model family can
extend it with its own fields by subclassing `ModelConfig` and naming the subclass in its
registry entry.
"""

import dataclasses
import fnmatch
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_serializer,
                      model_validator)

from jaxpar.models.activations import check_activation
from jaxpar.pallas_kernels.attention.spec import AttentionSpec


class Frozen(BaseModel):
  """Immutable, and unknown keys are errors rather than silently ignored."""
  model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class RopeScaling(Frozen):
  """Frequency scaling of RoPE: llama3 (Llama 3.1: low frequencies divided by `factor`,
  high ones kept, a smooth blend between), linear (every frequency divided by `factor`,
  as Gemma 3's global layers) or yarn (YaRN, GPT-OSS: frequencies that turn fewer than
  `beta_slow` times over `original_max_position` divided by `factor`, more than `beta_fast`
  kept, a linear ramp between; q and k scaled by `attention_factor`, by default
  0.1 ln(factor) + 1) or proportional (Gemma 4's global layers: the first `fraction` of
  head_dim's frequency pairs turn, at the frequencies of the whole head_dim, each divided by
  `factor`; the other pairs keep still). Each type reads only its own fields."""
  rope_type: Literal["llama3", "linear", "yarn", "proportional"] = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
  attention_factor: float | None = None
  # yarn in multi-head latent attention (DeepSeek-V3): the softmax scale is multiplied by
  # (0.1 mscale_all_dim ln(factor) + 1)^2; 0: not. Other attention blocks ignore it, as transformers does.
  mscale_all_dim: float = Field(0.0, ge=0)
  fraction: float = Field(1.0, gt=0, le=1)  # proportional: of head_dim's frequency pairs that turn


class QuantizationConfig(Frozen):
  """Quantized projection weights (attention q/k/v/o, MLP gate/up/down); embeddings, norms
  and the KV cache stay in param_dtype. For inference: `jaxpar quantize` writes such a model."""
  mode: Literal["int8", "int4", "w8a8"]
  group_size: Literal[32, 64, 128] | None = None  # int4 only: rows of K sharing one scale
  zero_point: bool = False  # int4 only: asymmetric groups (a zero point per group)
  outlier_channels: int = 0  # w8a8 only: input channels with the largest |x| kept in float
  implementation: Literal["auto", "pallas", "xla"] = "auto"  # see pallas_kernels.quantized_matmul

  @model_validator(mode="after")
  def _mode_options(self):
    int4 = self.mode == "int4"
    if int4 and self.group_size is None:
      raise ValueError("model.quantization.group_size is required for mode=int4: use 32, 64 or 128")
    if not int4 and (self.group_size is not None or self.zero_point):
      raise ValueError(f"model.quantization.group_size / zero_point apply to mode=int4 only, "
                       f"not mode={self.mode}: remove them")
    if self.outlier_channels and self.mode != "w8a8" or self.outlier_channels < 0:
      raise ValueError(f"model.quantization.outlier_channels={self.outlier_channels} needs "
                       "mode=w8a8 and a count >= 0")
    return self


# The projections adapters can attach to (models/lora.py): attention, then the feed-forward block's.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class LoRAConfig(Frozen):
  """Low-rank adapters (LoRA, models/lora.py): each projection whose name matches a pattern in
  `targets` computes W x + (alpha / rank) * B(A(x)), A [in, rank] and B [rank, out] being
  the only weights that train. `experts`: the routed experts' gate/up/down too (MoE).
  `base`: the checkpoint (run, checkpoints or step dir) holding the frozen base weights;
  None starts the base from the model's random init (tests, benchmarks)."""
  rank: int = Field(8, ge=1)
  alpha: float = Field(16.0, gt=0)
  targets: tuple[str, ...] = PROJECTIONS  # shell-style patterns over PROJECTIONS, e.g. "[qkvo]"
  experts: bool = False
  base: str | None = None
  # Serving only (jaxpar/inference/adapters.py): this many adapters stacked on each projection,
  # each batch row using its own (lora.rows_use_adapters); 0: one adapter, as trained.
  stacked: int = Field(0, ge=0)

  @model_validator(mode="after")
  def _targets(self):
    if self.stacked and self.experts:
      raise ValueError("model.lora.stacked: adapters on routed experts fold into the expert weights, "
                       "so they cannot differ per batch row: merge them (`jaxpar lora merge`) and serve the result")
    if not self.targets:
      raise ValueError(f"model.lora.targets is empty: name projections among {', '.join(PROJECTIONS)}")
    for pattern in self.targets:
      if not fnmatch.filter(PROJECTIONS, pattern):
        raise ValueError(f"model.lora.targets: {pattern!r} matches no projection; use names or "
                         f"patterns over {', '.join(PROJECTIONS)}")
    return self

  def targets_projection(self, name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in self.targets)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


class MedusaConfig(Frozen):
  """Medusa draft heads (Cai et al. 2024, Medusa-1; models/medusa.py): `heads` extra
  next-next-token predictors over the frozen model's final hidden state, head i guessing the
  token i + 2 ahead. Each is `layers` residual SiLU blocks, then its own output projection.
  Only the heads train (`train.objective: medusa`); `base`: the checkpoint holding the frozen
  model (None: the model's random init, for tests), as model.lora.base is for adapters.
  `shared_projection`: the heads use the model's output projection as it is, with no copy of
  their own: far fewer weights, and one read of the projection per round for all heads
  (where the projection is most of the model, as in small models with large vocabularies)."""
  heads: int = Field(4, ge=1, le=16)
  layers: int = Field(1, ge=1)
  shared_projection: bool = False
  base: str | None = None


REMAT_PRESETS = ("none", "full", "save_dots", "save_dots_no_batch")
# Activations the layers name with `checkpoint_name` (decoder.py, attention.py, mlp.py).
REMAT_NAMES = ("decoder_layer_input", "qkv_proj", "attention_out", "out_proj", "mlp_in", "mlp_out")
REMAT_ACTIONS = ("save", "offload", "recompute")


class HashableDict(dict):
  """A mapping a config holds (model.remat's {activation name: action},
  model.attention_options); hashable, as configs must be (the model keeps its config as a
  static attribute)."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))


def _check_remat(value):
  """One line naming the bad key and what would be valid, before pydantic's union errors."""
  if isinstance(value, dict):
    for name, action in value.items():
      if name not in REMAT_NAMES:
        raise ValueError(f"model.remat.{name}={action!r}: {name!r} is not a named activation; "
                         f"use {', '.join(REMAT_NAMES)}")
      if action not in REMAT_ACTIONS:
        raise ValueError(f"model.remat.{name}={action!r}: use one of {', '.join(REMAT_ACTIONS)}")
    return HashableDict(value)
  if value not in REMAT_PRESETS:
    raise ValueError(f"use a preset ({', '.join(REMAT_PRESETS)}) or a mapping of "
                     f"{', '.join(REMAT_NAMES)} to {' | '.join(REMAT_ACTIONS)}")
  return value


Remat = Annotated[str | dict[str, str], BeforeValidator(_check_remat), AfterValidator(_check_remat)]

# AttentionSpec fields the model section sets through keys of their own (or that the
# attention block and the kernels' doors set), so never through model.attention_options.
_SPEC_KEYS = {"mask": "model.sliding_window / layer_pattern", "logit_soft_cap": "model.attn_logit_soft_cap",
              "scale": "model.query_pre_attn_scalar", "implementation": "model.attention",
              "value_dim": "the attention block", "block_sizes": "the kernels' defaults",
              "interpret": "the attention door"}


def _check_attention_options(value: dict) -> HashableDict:
  """Further AttentionSpec fields for every layer's spec: keys the spec has and no other key
  sets (the values: the model section's check, as the spec checks itself with them all)."""
  free = sorted({f.name for f in dataclasses.fields(AttentionSpec)} - set(_SPEC_KEYS))
  for key in value:
    if key in _SPEC_KEYS:
      raise ValueError(f"model.attention_options.{key}: set it through {_SPEC_KEYS[key]}")
    if key not in free:
      raise ValueError(f"model.attention_options.{key} is not an AttentionSpec option "
                       f"(pallas_kernels/attention/spec.py); it takes {free or 'none yet'}")
  return HashableDict(value)


class LayerKind(Frozen):
  """One entry of `model.layer_pattern`: how the layers at its places differ from the
  model's defaults. Only the keys given apply; the rest come from the model section, so
  `{}` is a layer as the model section describes it and `{rope_scaling: null}` one without
  the model's scaling. Only `mixer` changes a layer's parameters."""
  sliding_window: int | None = Field(None, ge=1)  # None: full causal attention
  attn_logit_soft_cap: float | None = Field(None, gt=0)
  rope_theta: float = Field(10000.0, gt=0)
  rope_scaling: RopeScaling | None = None
  rope: bool = True  # False: no rotary position embedding (NoPE)
  # The layer's token mixer, a registered attention block (None: model.attention_block). The
  # one key here that changes parameters: the layers of each mixer are stacked apart
  # (models/transformer.py layer_groups), the scan running over units of the pattern.
  mixer: str | None = None

  @model_serializer(mode="wrap")
  def _given_keys_only(self, handler):
    # A saved config must read back with the same keys given (defaults are not overrides).
    return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class GatedDeltaNetConfig(Frozen):
  """The `gated_deltanet` token mixer (models/gated_deltanet.py): linear attention by the
  gated delta rule (Qwen3-Next, Qwen3.5). Value heads share key heads in groups, as query
  heads share kv heads in GQA. variant kimi: Kimi Delta Attention (Kimi Linear), a decay per
  key channel from a low-rank gate and a low-rank sigmoid output gate; one key head per
  value head, key and value heads of one size."""
  num_key_heads: int = Field(2, ge=1)
  num_value_heads: int = Field(4, ge=1)
  key_head_dim: int = Field(32, ge=1)
  value_head_dim: int = Field(32, ge=1)
  conv_kernel: int = Field(4, ge=1)  # the short causal convolution over q, k and v
  chunk_size: int = Field(64, ge=1)  # tokens per chunk of the chunked (training, prefill) form
  implementation: Literal["auto", "reference", "chunked", "pallas"] = "auto"  # pallas_kernels.gated_delta_rule
  variant: Literal["qwen", "kimi"] = "qwen"

  @model_validator(mode="after")
  def _groups(self):
    if self.num_value_heads % self.num_key_heads:
      raise ValueError(f"model.gated_deltanet.num_key_heads={self.num_key_heads} must divide "
                       f"num_value_heads={self.num_value_heads}")
    if self.variant == "kimi" and (self.num_key_heads != self.num_value_heads
                                   or self.key_head_dim != self.value_head_dim):
      raise ValueError("model.gated_deltanet.variant=kimi has one key head per value head, of one size: set "
                       f"num_key_heads = num_value_heads (got {self.num_key_heads}, {self.num_value_heads}) and "
                       f"key_head_dim = value_head_dim (got {self.key_head_dim}, {self.value_head_dim})")
    return self


class ModelConfig(Frozen):
  family: str = "llama"  # a registered model family (jaxpar.models.registry)
  mlp: str = "dense"  # the feed-forward block: a registered block name
  attention_block: str = "gqa"  # the attention block: a registered block name
  layer_block: str = "pre_norm"  # the decoder layer around the two: a registered block name
  first_dense_layers: int = 0  # the first N layers use the dense block whatever `mlp` says
  vocab_size: int = 512
  embed_dim: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 32
  mlp_dim: int = 512
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rope_fraction: float = Field(1.0, gt=0, le=1)  # of head_dim that rotates (HF partial_rotary_factor)
  # Keys at most this far back (the query's own included) on every layer (Mistral); None: all.
  sliding_window: int | None = Field(None, ge=1)
  attn_logit_soft_cap: float | None = Field(None, gt=0)  # cap * tanh(logits / cap) (Gemma 2)
  final_logit_soft_cap: float | None = Field(None, gt=0)  # the same on the output logits (Gemma 2)
  # Attention scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma).
  query_pre_attn_scalar: int | None = Field(None, gt=0)
  scale_embeddings: bool = False  # embeddings x sqrt(embed_dim), in param_dtype (Gemma)
  # RMSNorms multiply by (1 + scale), their scale starting at 0: Gemma's layout, so checkpoints
  # (and bf16 scales near 1) are stored as Gemma stores them.
  norm_unit_offset: bool = False
  # The gated MLP's (models/activations.py): silu (SwiGLU), gelu_tanh (GeGLU, Gemma).
  mlp_activation: Annotated[str, AfterValidator(check_activation)] = "silu"
  # Per-layer differences, cycled over the layers by absolute index: layer i is entry
  # i % len. E.g. Gemma 3: five {sliding_window: 1024, rope_theta: 10000, rope_scaling: null}
  # then one {}. Empty: every layer as above.
  layer_pattern: tuple[LayerKind, ...] = ()
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qk_norm: bool = False
  attention_bias: bool = False  # q/k/v projection biases (Qwen2 / Qwen2.5)
  attention_out_bias: bool = False  # an o projection bias (GPT-OSS, with attention_bias)
  # A learned logit per query head that joins every row's softmax with a zero value (GPT-OSS).
  attention_sinks: bool = False
  # Attention's output times sigmoid(a gate projection of the layer input), per head and
  # channel, before the o projection (Qwen3-Next, Qwen3.5).
  attention_output_gate: bool = False
  gated_deltanet: GatedDeltaNetConfig | None = None  # the `gated_deltanet` mixer's shape
  # Per-layer input embeddings (Gemma 4's PLE; models/per_layer_inputs.py): each layer adds a
  # gated projection of its own [per_layer_input_dim] slice of a second token embedding
  # (of per_layer_vocab_size rows; None: vocab_size) mixed with a projection of the first.
  # 0: none.
  per_layer_input_dim: int = Field(0, ge=0)
  per_layer_vocab_size: int | None = Field(None, ge=1)
  param_dtype: Literal["float32", "bfloat16"] = "float32"
  compute_dtype: Literal["float32", "bfloat16"] = "float32"
  scan_layers: bool = True
  # Layers per scan iteration. On CPU, unrolling a small stack halves the backward time
  # (XLA CPU runs the while loop's per-layer gradient updates poorly); compile time grows.
  scan_unroll: int = 1
  # A preset, or per named activation: keep in HBM (save), move to host memory (offload), or
  # recompute in the backward pass; names left out are recomputed.
  remat: Remat = "none"
  # Run the dense feed-forward block over the sequence in this many pieces, one at a time,
  # each recomputed on its own in the backward pass: its [tokens, mlp_dim] intermediates
  # (2.2 GiB each for Llama 3 70B at 5 x 8192 tokens per chip) shrink by this factor.
  mlp_chunks: int = 1
  attention: Literal["auto", "flash", "reference", "chunked"] = "auto"
  # Further AttentionSpec fields every layer's spec takes (pallas_kernels/attention/spec.py):
  # an option added to the spec is set here, with no config key of its own.
  attention_options: Annotated[dict[str, bool | int | float | str],
                               AfterValidator(_check_attention_options)] = HashableDict()
  quantization: QuantizationConfig | None = None  # None: float projections
  # The projections' matmuls while training (models/low_precision.py): fp8 (per-tensor
  # scales), fp8_blockwise (DeepSeek-V3's 1 x 128 tiles, 128 x 128 weight blocks) or int8 (per row; int8_stochastic:
  # gradients rounded stochastically), quantized on the fly over float weights;
  # compute_dtype: no quantization.
  # fp8_delayed: fp8 with each scale from the largest of the tensor's last `fp8_amax_history`
  # absolute maxima, kept in the train state (models/low_precision_delayed.py).
  train_precision: Literal["compute_dtype", "fp8", "fp8_delayed", "fp8_blockwise", "int8",
                           "int8_stochastic"] = "compute_dtype"
  fp8_amax_history: int = Field(16, ge=1)
  lora: LoRAConfig | None = None  # None: no adapters
  medusa: MedusaConfig | None = None  # None: no draft heads

  @property
  def frozen_base(self) -> tuple[str, str | None] | None:
    """(config section, base checkpoint) of the weights trained over a frozen base (adapters
    or draft heads), or None when the whole model trains."""
    for section in ("lora", "medusa"):
      if getattr(self, section) is not None:
        return f"model.{section}", getattr(self, section).base
    return None

  def _check_delayed_scaling_reach(self):
    """fp8_delayed keeps a history per projection on the attention and dense MLP blocks; the
    other blocks (experts' grouped matmuls, latent and linear attention, Gemma 4's) and a
    chunked MLP (a loop the history cannot be written from) are refused in one line."""
    mixers = {k.mixer for k in self.layer_pattern} - {None, "gqa"}
    reach = {"model.mlp": self.mlp if self.mlp != "dense" else None,
             "model.attention_block": self.attention_block if self.attention_block != "gqa" else None,
             "model.layer_pattern mixer": ", ".join(sorted(mixers)) or None,
             "model.mlp_chunks": self.mlp_chunks if self.mlp_chunks > 1 else None}
    for key, value in reach.items():
      if value is not None:
        raise ValueError(f"model.train_precision=fp8_delayed keeps scaling histories for the attention and "
                         f"dense MLP projections only, not {key}={value}: train with model.train_precision=fp8")

  @model_validator(mode="after")
  def _heads(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                       f"model.num_heads={self.num_heads}")
    q = self.quantization
    if q is not None and self.train_precision != "compute_dtype":
      raise ValueError(f"model.train_precision={self.train_precision} quantizes float weights on the fly; "
                       "a model.quantization model stores them quantized: set one of the two")
    if self.train_precision == "fp8_delayed":
      self._check_delayed_scaling_reach()
    if q is not None and q.group_size is not None:
      # Groups run along each projection's last contracted dim: embed (q/k/v/gate/up),
      # head_dim (o) and mlp (down).
      for key in ("embed_dim", "head_dim", "mlp_dim"):
        if getattr(self, key) % q.group_size:
          raise ValueError(f"model.quantization.group_size={q.group_size} does not divide "
                           f"model.{key}={getattr(self, key)}: use a group size that divides "
                           "embed_dim, head_dim and mlp_dim")
    if q is not None and q.outlier_channels >= min(self.embed_dim, self.mlp_dim):
      raise ValueError(f"model.quantization.outlier_channels={q.outlier_channels} must be below "
                       f"model.embed_dim={self.embed_dim} and model.mlp_dim={self.mlp_dim}")
    AttentionSpec(implementation=self.attention, **self.attention_options)  # the spec checks itself
    if self.mlp_chunks < 1:
      raise ValueError(f"model.mlp_chunks={self.mlp_chunks} must be at least 1 (1: the block runs whole)")
    mixers = {self.attention_block} | {k.mixer for k in self.layer_pattern if k.mixer}
    if "gated_deltanet" in mixers and self.gated_deltanet is None:
      raise ValueError("model.layer_pattern uses mixer gated_deltanet: give its shape in model.gated_deltanet "
                       "(num_key_heads, num_value_heads, key_head_dim, value_head_dim)")
    if self.lora is not None and self.medusa is not None:
      raise ValueError("model.lora and model.medusa both train over a frozen base: merge the adapters first "
                       "(`jaxpar lora merge`) and train the heads over the merged model")
    if not 0 <= self.first_dense_layers <= self.num_layers:
      raise ValueError(f"model.first_dense_layers={self.first_dense_layers} must be between 0 and "
                       f"model.num_layers={self.num_layers}")
    return self
