"""The `sandwich_norm` decoder layer of the Gemma families: a norm before and after each
block."""

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.mesh import constrain
from jaxpar.models.decoder import BLOCK_INPUT, RESIDUAL
from jaxpar.models.norm import RMSNorm
from jaxpar.models.registry import get_block, register_block


class SandwichNormLayer(nnx.Module):
  """x + post_norm(attention(norm(x))), then x + post_norm(feed_forward(norm(x))): the
  `sandwich_norm` decoder layer. Parameters: attn_norm, attn_post_norm, mlp_norm,
  mlp_post_norm (RMSNorm scales) around the config's attention and feed-forward blocks."""

  def __init__(self, cfg, rngs: nnx.Rngs, *, feed_forward: str | None = None, mixer: str | None = None):
    dtypes = dict(param_dtype=jnp.dtype(cfg.param_dtype), compute_dtype=jnp.dtype(cfg.compute_dtype))
    norm = lambda: RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, **dtypes)  # noqa: E731
    self.attn_norm, self.attn_post_norm = norm(), norm()
    self.attn = get_block("attention", mixer or cfg.attention_block)(cfg, rngs=rngs, **dtypes)
    self.mlp_norm, self.mlp_post_norm = norm(), norm()
    self.mlp = get_block("feed_forward", feed_forward or cfg.mlp)(cfg, rngs=rngs, **dtypes)

  def __call__(self, x, context, cache, options):
    x = checkpoint_name(x, "decoder_layer_input")
    attended, cache = self.attn(constrain(self.attn_norm(x), BLOCK_INPUT), context, cache, options)
    x, aux = self.feed(x + constrain(self.attn_post_norm(attended), RESIDUAL))
    return x, aux, cache

  def feed(self, x):
    """The feed-forward half: x + post_norm(feed_forward(norm(x))), and its aux."""
    fed, aux = self.mlp(constrain(self.mlp_norm(x), BLOCK_INPUT))
    return x + constrain(self.mlp_post_norm(fed), RESIDUAL), aux


register_block("decoder_layer", "sandwich_norm", SandwichNormLayer)
