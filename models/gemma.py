"""The Gemma families: Gemma 2 and Gemma 3 (text).

Both are the generic `Transformer` with the `sandwich_norm` decoder layer (a norm before
and after each block), GeGLU, embeddings scaled by sqrt(embed_dim), RMSNorms that multiply
by (1 + scale) and attention scaled by query_pre_attn_scalar ** -0.5. What tells them
apart is a config default:

- gemma2: local (4096-key window) and global layers alternate; attention logits are
  soft-capped at 50 and the output logits at 30.
- gemma3: five local layers (1024 keys, RoPE base 10k) to one global (base 1M, linear
  scaling x8), QK-norm, no soft-capping.
"""

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.mesh import constrain
from jaxpar.models import gemma_hf
from jaxpar.models.config import LayerKind, ModelConfig, RopeScaling
from jaxpar.models.decoder import BLOCK_INPUT, RESIDUAL
from jaxpar.models.flops import dense_train_flops_per_token
from jaxpar.models.norm import RMSNorm
from jaxpar.models.registry import ModelFamily, get_block, register_block, register_family
from jaxpar.models.transformer import Transformer


class SandwichNormLayer(nnx.Module):
  """x + post_norm(attention(norm(x))), then x + post_norm(feed_forward(norm(x))): the
  `sandwich_norm` decoder layer. Parameters: attn_norm, attn_post_norm, mlp_norm,
  mlp_post_norm (RMSNorm scales) around the config's attention and feed-forward blocks."""

  def __init__(self, cfg, rngs: nnx.Rngs, *, feed_forward: str | None = None):
    dtypes = dict(param_dtype=jnp.dtype(cfg.param_dtype), compute_dtype=jnp.dtype(cfg.compute_dtype))
    norm = lambda: RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, **dtypes)  # noqa: E731
    self.attn_norm, self.attn_post_norm = norm(), norm()
    self.attn = get_block("attention", cfg.attention_block)(cfg, rngs=rngs, **dtypes)
    self.mlp_norm, self.mlp_post_norm = norm(), norm()
    self.mlp = get_block("feed_forward", feed_forward or cfg.mlp)(cfg, rngs=rngs, **dtypes)

  def __call__(self, x, context, cache, options):
    x = checkpoint_name(x, "decoder_layer_input")
    attended, cache = self.attn(constrain(self.attn_norm(x), BLOCK_INPUT), context, cache, options)
    x = x + constrain(self.attn_post_norm(attended), RESIDUAL)
    fed, aux = self.mlp(constrain(self.mlp_norm(x), BLOCK_INPUT))
    return x + constrain(self.mlp_post_norm(fed), RESIDUAL), aux, cache


register_block("decoder_layer", "sandwich_norm", SandwichNormLayer)


class GemmaConfig(ModelConfig):
  """What Gemma 2 and 3 share, as defaults of the model section."""
  layer_block: str = "sandwich_norm"
  mlp_activation: str = "gelu_tanh"
  scale_embeddings: bool = True
  norm_unit_offset: bool = True
  tie_embeddings: bool = True
  norm_eps: float = 1e-6
  query_pre_attn_scalar: int | None = 256


class Gemma2Config(GemmaConfig):
  family: str = "gemma2"
  attn_logit_soft_cap: float | None = 50.0
  final_logit_soft_cap: float | None = 30.0
  layer_pattern: tuple[LayerKind, ...] = (LayerKind(sliding_window=4096), LayerKind())


class Gemma3Config(GemmaConfig):
  family: str = "gemma3"
  qk_norm: bool = True
  rope_theta: float = 1_000_000.0
  rope_scaling: RopeScaling | None = RopeScaling(rope_type="linear", factor=8.0)
  layer_pattern: tuple[LayerKind, ...] = (
      (LayerKind(sliding_window=1024, rope_theta=10_000.0, rope_scaling=None),) * 5 + (LayerKind(),))


for _name, _config, _hf in (("gemma2", Gemma2Config, gemma_hf.GEMMA2), ("gemma3", Gemma3Config, gemma_hf.GEMMA3)):
  register_family(ModelFamily(name=_name, module=Transformer, flops_per_token=dense_train_flops_per_token,
                              config=_config, rules="fsdp_tp", hf=_hf))
