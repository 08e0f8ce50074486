"""Gemma 4's blocks: the `gemma4` (local) and `gemma4_global` attention blocks and the `gemma4`
decoder layer.

Both attention blocks are GQA with q and k RMS-normed and v normed without a scale. The
global one has heads of the model's `global_head_dim` and `global_kv_heads` (so its layers
are a stack of their own) and, with `keys_as_values`, no v projection. The layer is Gemma's
sandwich-norm layer, then the per-layer input block (with `model.per_layer_input_dim`), then
a learned scalar times the whole.
"""

import jax.numpy as jnp
from flax import nnx

from jaxpar.mesh import constrain
from jaxpar.models.activations import gated
from jaxpar.models.attention import Attention
from jaxpar.models.decoder import RESIDUAL
from jaxpar.models.dense import dense
from jaxpar.models.families.gemma.layer import SandwichNormLayer
from jaxpar.models.init import fan_in
from jaxpar.models.norm import RMSNorm, normalize
from jaxpar.models.registry import register_block


class LocalAttention(Attention):
  """`gemma4`: GQA over the model's heads, values RMS-normed without a scale."""

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    super().__init__(self.layer_config(cfg), param_dtype=param_dtype, compute_dtype=compute_dtype, rngs=rngs)
    self.eps = cfg.norm_eps

  @staticmethod
  def layer_config(cfg):
    return cfg

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


class Gemma4Layer(SandwichNormLayer):
  """The sandwich-norm layer, then x + norm(up(act(gate(x)) * its per-layer input)) when
  the model has per-layer inputs, then x times the layer's scalar. Parameters beyond
  the sandwich layer's: layer_scalar [1]; with per-layer inputs, input_gate [embed, per_layer],
  input_up [per_layer, embed] and input_norm."""

  def __init__(self, cfg, rngs: nnx.Rngs, **kwargs):
    super().__init__(cfg, rngs, **kwargs)
    dtype = jnp.dtype(cfg.param_dtype)
    # A gain, not decayed; HF keeps it as a buffer that checkpoints hold.
    self.layer_scalar = nnx.Param(jnp.ones((1,), dtype), out_sharding=(None,), weight_decay=False)
    self.glu = gated(cfg.mlp_activation)  # act(gate) * the per-layer input
    p = cfg.per_layer_input_dim
    if p:
      self.input_gate = nnx.Param(fan_in()(rngs.params(), (cfg.embed_dim, p), dtype), out_sharding=("embed", None))
      self.input_up = nnx.Param(fan_in()(rngs.params(), (p, cfg.embed_dim), dtype), out_sharding=(None, "embed"))
      self.input_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=dtype,
                                compute_dtype=jnp.dtype(cfg.compute_dtype), unit_offset=cfg.norm_unit_offset)
    self.has_inputs, self.dtype = bool(p), jnp.dtype(cfg.compute_dtype)

  def __call__(self, x, context, cache, options):
    x, aux, cache = super().__call__(x, context, cache, options)
    if self.has_inputs:
      hidden = self.glu(dense(x, self.input_gate, dtype=self.dtype), context.layer_input().astype(self.dtype))
      x = x + constrain(self.input_norm(dense(hidden, self.input_up, dtype=self.dtype)), RESIDUAL)
    return x * self.layer_scalar[...].astype(x.dtype), aux, cache


register_block("attention", "gemma4", LocalAttention)
register_block("attention", "gemma4_global", GlobalAttention)
register_block("decoder_layer", "gemma4", Gemma4Layer)
