"""Gemma 4's blocks: the `gemma4` (local) and `gemma4_global` attention blocks, the
`gemma4_shared` and `gemma4_global_shared` blocks that reuse an earlier layer's keys and
values, and the `gemma4` decoder layer.

Both attention blocks are GQA with q and k RMS-normed and v normed without a scale. The
global one has heads of the model's `global_head_dim` and `global_kv_heads` (so its layers
are a stack of their own) and, with `keys_as_values`, no v projection. The layer is Gemma's
sandwich-norm layer with experts beside its MLP (with `model.moe`), then the per-layer input
block (with `model.per_layer_input_dim`), then a learned scalar times the whole.
"""

import jax.numpy as jnp
from flax import nnx

from jaxpar.mesh import constrain
from jaxpar.models import lora
from jaxpar.models.activations import gated
from jaxpar.models.attention import Attention
from jaxpar.models.decoder import BLOCK_INPUT, RESIDUAL
from jaxpar.models.dense import dense, projection
from jaxpar.models.families.gemma.layer import SandwichNormLayer
from jaxpar.models.flops import dense_train_flops_per_token
from jaxpar.models.init import fan_in
from jaxpar.models.layer_pattern import layer_mixer
from jaxpar.models.moe import MoE
from jaxpar.models.norm import RMSNorm, normalize
from jaxpar.models.registry import register_block
from jaxpar.models.rope import apply_rope


class LocalAttention(Attention):
  """`gemma4`: GQA over the model's heads, values RMS-normed without a scale."""

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    super().__init__(self.layer_config(cfg), param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
    self.eps = cfg.norm_eps

  def project_qkv(self, x):
    q, k, v = super().project_qkv(x)
    return q, k, normalize(v, self.eps).astype(v.dtype)


class GlobalAttention(LocalAttention):
  """`gemma4_global`: the global layers' heads (`global_head_dim`, `global_kv_heads`); their
  values are their keys (before the keys' norm and RoPE) with `keys_as_values`."""

  def __init__(self, cfg, **kwargs):
    self.values_are_keys = cfg.keys_as_values
    super().__init__(cfg, **kwargs)

  @staticmethod
  def layer_config(cfg):
    return cfg.global_layers()

  @staticmethod
  def matmul_params(cfg) -> int:
    own = cfg.global_layers()
    return Attention.matmul_params(own) - cfg.keys_as_values * own.embed_dim * own.head_dim * own.num_kv_heads

  @staticmethod
  def head_dims(cfg) -> tuple[int, int]:
    return Attention.head_dims(cfg.global_layers())

  @staticmethod
  def init_cache(cfg, *args, **kwargs) -> dict:
    return Attention.init_cache(cfg.global_layers(), *args, **kwargs)


class SharedAttention(nnx.Module):
  """`gemma4_shared`: a local layer that reuses the keys and values of the last earlier
  `gemma4` layer (the E2B/E4B models' last layers), so it keeps none: q projected, normed
  and rotated, attending over its source layer's cache (`cache.attend`), then the o
  projection. Parameters: q, q_norm, o."""

  kv_source_mixer = "gemma4"  # whose keys and values it reads (models/transformer.py)

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    own = self.layer_config(cfg)
    e, h, d = own.embed_dim, own.num_heads, own.head_dim
    proj = dict(param_dtype=param_dtype, quantization=own.quantization)
    self.q = projection(fan_in(in_axis=0, out_axis=(1, 2)), rngs.params(), (e, h, d), ("embed", "heads", "head_dim"),
                        **proj)
    self.o = projection(fan_in(in_axis=(0, 1), out_axis=2), rngs.params(), (h, d, e),
                        ("heads", "head_dim", "embed"), contract=2, **proj)
    self.lora = lora.adapters(own.lora, rngs, q=self.q, o=self.o)
    self.q_norm = RMSNorm(d, eps=own.norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype,
                          names=("head_dim",), unit_offset=own.norm_unit_offset)
    self.dtype, self.precision = compute_dtype, own.train_precision

  @staticmethod
  def layer_config(cfg):
    return cfg

  def __call__(self, x, context, cache, options):
    dt = self.dtype
    q = self.q_norm(dense(x, self.q, dtype=dt, adapter=lora.adapter(self.lora, "q"), precision=self.precision))
    if options.rope is not None:
      q = apply_rope(q, context.sequence_positions, options.rope.frequencies(q.shape[-1]),
                     options.rope.attention_factor())
    out = cache.attend(constrain(q, ("batch", "length", "act_heads", "head_dim")), context, options.attention)
    o = dense(out, self.o, contract=2, dtype=dt, adapter=lora.adapter(self.lora, "o"), precision=self.precision)
    return o, cache

  @classmethod
  def matmul_params(cls, cfg) -> int:
    own = cls.layer_config(cfg)
    return 2 * own.embed_dim * own.num_heads * own.head_dim

  @classmethod
  def head_dims(cls, cfg) -> tuple[int, int]:
    return Attention.head_dims(cls.layer_config(cfg))

  @staticmethod
  def init_cache(cfg, *args, **kwargs) -> dict:
    return {}  # its source layer's pages hold its keys and values


class SharedGlobalAttention(SharedAttention):
  """`gemma4_global_shared`: the same over the last earlier `gemma4_global` layer, with the
  global layers' heads."""

  kv_source_mixer = "gemma4_global"

  @staticmethod
  def layer_config(cfg):
    return cfg.global_layers()


SHARED_MIXERS = ("gemma4_shared", "gemma4_global_shared")


class Gemma4Experts(MoE):
  """The experts beside Gemma 4's MLP (the 26B-A4B model): a softmax router over
  rms(x) * router_scale / sqrt(embed), the top-k weights renormalised and then multiplied by
  each chosen expert's `expert_scale`. Parameters beyond the MoE block's: router_scale
  [embed], expert_scale [experts]."""

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    super().__init__(cfg, param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
    gain = lambda n, names: nnx.Param(jnp.ones((n,), param_dtype), out_sharding=names,  # noqa: E731
                                      weight_decay=False)
    self.router_scale, self.expert_scale = gain(cfg.embed_dim, ("norm",)), gain(cfg.moe.num_experts, ("experts",))
    self.eps = cfg.norm_eps

  def router_logits(self, x):
    scaled = normalize(x, self.eps) * self.router_scale[...].astype(jnp.float32) * x.shape[-1] ** -0.5
    return dense(scaled, self.router[...].astype(jnp.float32))

  def routed_weights(self, ids, weights):
    return weights * self.expert_scale[...].astype(jnp.float32)[ids]


class Gemma4Layer(SandwichNormLayer):
  """The sandwich-norm layer, its feed-forward half with the experts beside the MLP when
  the model has them (`model.moe`): x + post_norm(post_norm_1(mlp(norm(x))) +
  experts_post_norm(experts(experts_norm(x)))), the experts routed by x itself; then
  x + norm(up(act(gate(x)) * its per-layer input)) when the model has per-layer inputs;
  then x times the layer's scalar. Parameters beyond the sandwich layer's: layer_scalar
  [1]; with experts, `experts` and three norms; with per-layer inputs, input_gate
  [embed, per_layer], input_up [per_layer, embed] and input_norm."""

  def __init__(self, cfg, rngs: nnx.Rngs, **kwargs):
    if cfg.double_wide_mlp and kwargs.get("mixer") in SHARED_MIXERS:  # the sharing layers' MLP is twice as wide
      cfg = cfg.model_copy(update={"mlp_dim": 2 * cfg.mlp_dim})
    super().__init__(cfg, rngs, **kwargs)
    dtype = jnp.dtype(cfg.param_dtype)
    dtypes = dict(param_dtype=dtype, compute_dtype=jnp.dtype(cfg.compute_dtype))
    norm = lambda: RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, **dtypes)  # noqa: E731
    self.experts = None if cfg.moe is None else Gemma4Experts(cfg, rngs=rngs, **dtypes)
    if cfg.moe is not None:
      self.mlp_post_norm_1, self.experts_norm, self.experts_post_norm = norm(), norm(), norm()
    # A gain, not decayed; HF keeps it as a buffer that checkpoints hold.
    self.layer_scalar = nnx.Param(jnp.ones((1,), dtype), out_sharding=(None,), weight_decay=False)
    self.glu = gated(cfg.mlp_activation)  # act(gate) * the per-layer input
    p = cfg.per_layer_input_dim
    if p:
      self.input_gate = nnx.Param(fan_in()(rngs.params(), (cfg.embed_dim, p), dtype), out_sharding=("embed", None))
      self.input_up = nnx.Param(fan_in()(rngs.params(), (p, cfg.embed_dim), dtype), out_sharding=(None, "embed"))
      self.input_norm = norm()
    self.has_inputs, self.dtype = bool(p), jnp.dtype(cfg.compute_dtype)

  def feed(self, x):
    if self.experts is None:
      return super().feed(x)
    fed, _ = self.mlp(constrain(self.mlp_norm(x), BLOCK_INPUT))
    routed, aux = self.experts.mix(constrain(self.experts_norm(x), BLOCK_INPUT), self.experts.router_logits(x))
    both = self.mlp_post_norm_1(fed) + self.experts_post_norm(routed)
    return x + constrain(self.mlp_post_norm(both), RESIDUAL), aux

  def __call__(self, x, context, cache, options):
    x, aux, cache = super().__call__(x, context, cache, options)
    if self.has_inputs:
      hidden = self.glu(dense(x, self.input_gate, dtype=self.dtype), context.layer_input().astype(self.dtype))
      x = x + constrain(self.input_norm(dense(hidden, self.input_up, dtype=self.dtype)), RESIDUAL)
    return x * self.layer_scalar[...].astype(x.dtype), aux, cache


def train_flops_per_token(cfg, seq_len: int) -> float:
  """The dense count (per-layer inputs included) plus each layer's router and the k experts
  a token visits, and the second half of the sharing layers' double-wide MLPs."""
  m = cfg.moe
  experts = 0 if m is None else cfg.embed_dim * (m.num_experts + 3 * m.experts_per_token * m.expert_mlp_dim)
  wide = cfg.double_wide_mlp * sum(layer_mixer(cfg, i) in SHARED_MIXERS for i in range(cfg.num_layers))
  return (dense_train_flops_per_token(cfg, seq_len) + 6 * cfg.num_layers * experts
          + 6 * wide * 3 * cfg.embed_dim * cfg.mlp_dim)


register_block("attention", "gemma4", LocalAttention)
register_block("attention", "gemma4_global", GlobalAttention)
register_block("attention", "gemma4_shared", SharedAttention)
register_block("attention", "gemma4_global_shared", SharedGlobalAttention)
register_block("decoder_layer", "gemma4", Gemma4Layer)
