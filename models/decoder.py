"""The decoder layer (`model.layer_block`): `pre_norm`, attention then the feed-forward block.

A layer is `(x, context, cache, options) -> (x, aux, cache)`: `context` what every layer of
the pass shares (LayerContext), `cache` this layer's view of where keys and values come
from (models/caches.py), `options` its static per-layer options (layer_pattern.py); `aux`
holds the feed-forward block's auxiliary losses and metrics (empty for a dense MLP).
A family with another layout (Gemma 2's norms around each block) registers its own layer.
"""

import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from jaxpar.errors import ConfigError
from jaxpar.mesh import constrain
from jaxpar.models.norm import RMSNorm
from jaxpar.models.registry import get_block, register_block
from jaxpar.pallas_kernels import TreeMask

# The residual stream [B, L, embed] between blocks. Its length has its own name so the
# rules can split it further than attention's (Megatron sequence parallelism): then the
# normed input of each block is gathered to the blocks' layout once (BLOCK_INPUT), and
# each block's output is reduce-scattered back.
RESIDUAL = ("batch", "residual_length", "act_embed")
BLOCK_INPUT = ("batch", "length", "act_embed")


@struct.dataclass
class LayerContext:
  """What every layer of one forward pass needs (closed over by the layer scan).

  positions, segment_ids: int [B, L] (segment ids None: one sequence per row); zigzag: the
  length axis is in zig-zag order over the context devices (load balancing).
  Speculative decoding's tree pass (generation only): `tree` (a TreeMask) says which of the
  pass's tokens each one sees; `positions` are then the cache slots the tokens are written
  at and `rope_positions` the positions they take in the sequence (the root's plus depth).
  """
  positions: jnp.ndarray
  segment_ids: jnp.ndarray | None = None
  zigzag: bool = struct.field(pytree_node=False, default=False)
  rope_positions: jnp.ndarray | None = None
  tree: TreeMask | None = struct.field(pytree_node=False, default=None)
  # Per-layer inputs [B, L, layers, dim] (models/per_layer_inputs.py), and the index over
  # the whole stack of the layer this context is handed to (set by the stack's layer function).
  layer_inputs: jnp.ndarray | None = None
  layer_index: jnp.ndarray | None = None

  def layer_input(self):
    """This layer's per-layer input [B, L, dim]."""
    return self.layer_inputs[:, :, self.layer_index]

  @property
  def sequence_positions(self):
    """Where each token sits in its sequence: what rotary embeddings rotate by."""
    return self.positions if self.rope_positions is None else self.rope_positions

  def attention_spec(self, spec):
    """A layer's spec for this pass: its own, or with the tree's mask over a causal one."""
    if self.tree is None:
      return spec
    if spec.mask.window is not None or not spec.causal:
      raise ConfigError("a speculative tree pass needs causal attention over the whole cache: serve a model "
                        "with sliding-window layers with a chain (no tree)")
    return spec.replace(mask=self.tree)


class DecoderLayer(nnx.Module):
  """x + attention(norm(x)), then x + feed_forward(norm(x)); x is [B, L, embed]. The blocks
  are the config's (`model.attention_block` and `model.mlp`) unless the stack says (`mixer`,
  `feed_forward`)."""

  def __init__(self, cfg, rngs: nnx.Rngs, *, feed_forward: str | None = None, mixer: str | None = None):
    dtypes = dict(param_dtype=jnp.dtype(cfg.param_dtype), compute_dtype=jnp.dtype(cfg.compute_dtype))
    self.attn_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, **dtypes)
    self.attn = get_block("attention", mixer or cfg.attention_block)(cfg, rngs=rngs, **dtypes)
    self.mlp_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, unit_offset=cfg.norm_unit_offset, **dtypes)
    self.mlp = get_block("feed_forward", feed_forward or cfg.mlp)(cfg, rngs=rngs, **dtypes)

  def __call__(self, x, context: LayerContext, cache, options):
    x = checkpoint_name(x, "decoder_layer_input")
    attended, cache = self.attn(constrain(self.attn_norm(x), BLOCK_INPUT), context, cache, options)
    x = x + constrain(attended, RESIDUAL)
    fed, aux = self.mlp(constrain(self.mlp_norm(x), BLOCK_INPUT))
    return x + constrain(fed, RESIDUAL), aux, cache


register_block("decoder_layer", "pre_norm", DecoderLayer)
