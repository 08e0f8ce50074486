"""One pre-norm decoder layer: attention, then the feed-forward block the config names.

The layer is `(x, context, cache) -> (x, aux, cache)`: `aux` holds the block's auxiliary
losses and metrics (empty for a dense MLP), `cache` this layer's KV cache (None in training).
"""

import jax.numpy as jnp
from flax import nnx, struct
from jax.ad_checkpoint import checkpoint_name

from jaxpar.mesh import constrain
from jaxpar.models.attention import Attention
from jaxpar.models.kv_quant import KVQuantization
from jaxpar.models.norm import RMSNorm
from jaxpar.models.registry import get_block

# The residual stream [B, L, embed] between blocks. Its length has its own name so the
# rules can split it further than attention's (Megatron sequence parallelism): then the
# normed input of each block is gathered to the blocks' layout once (BLOCK_INPUT), and
# each block's output is reduce-scattered back.
RESIDUAL = ("batch", "residual_length", "act_embed")
BLOCK_INPUT = ("batch", "length", "act_embed")


@struct.dataclass
class LayerContext:
  """What every layer of one forward pass shares (closed over by the layer scan).

  positions, segment_ids: int [B, L]; inv_freq: RoPE frequencies [head_dim / 2];
  page_table: int [B, pages] when attending through a paged KV cache, else None;
  kv_quantization: how the KV cache is quantized (a kv_quant.KVQuantization): with a cache,
  it is stored so (models/kv_cache_quantized.py); in a full forward, attention reads as a
  decode step would (`kv_quant.cached_attention`: how quality is measured); else None.
  tail_index: int [B], each row's slot (its float tail page) in a quantized cache.
  zigzag: the length axis is in zig-zag order over the context devices (load balancing).
  """
  positions: jnp.ndarray
  segment_ids: jnp.ndarray | None
  inv_freq: jnp.ndarray
  page_table: jnp.ndarray | None = None
  kv_quantization: KVQuantization | None = struct.field(pytree_node=False, default=None)
  tail_index: jnp.ndarray | None = None
  zigzag: bool = struct.field(pytree_node=False, default=False)


class DecoderLayer(nnx.Module):
  """x + attention(norm(x)), then x + feed_forward(norm(x)); x is [B, L, embed]."""

  def __init__(self, cfg, rngs: nnx.Rngs, *, feed_forward: str | None = None):
    dtypes = dict(param_dtype=jnp.dtype(cfg.param_dtype), compute_dtype=jnp.dtype(cfg.compute_dtype))
    self.attn_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, **dtypes)
    self.attn = Attention(cfg, rngs=rngs, **dtypes)
    self.mlp_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, **dtypes)
    self.mlp = get_block("feed_forward", feed_forward or cfg.mlp)(cfg, rngs=rngs, **dtypes)

  def __call__(self, x, context: LayerContext, cache=None):
    x = checkpoint_name(x, "decoder_layer_input")
    attended, cache = self.attn(constrain(self.attn_norm(x), BLOCK_INPUT), context, cache)
    x = x + constrain(attended, RESIDUAL)
    fed, aux = self.mlp(constrain(self.mlp_norm(x), BLOCK_INPUT))
    return x + constrain(fed, RESIDUAL), aux, cache
