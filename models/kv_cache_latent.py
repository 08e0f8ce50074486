"""The latent cache of multi-head latent attention: per token and layer, only the
kv_lora_rank latent and the rotated key part (576 values for DeepSeek-V3, against
2 x heads x head_dim for a GQA cache).

Pages `[1, num_pages, page_size, kv_lora_rank + qk_rope_head_dim]` per layer, stacked
like kv_cache.py's (one "kv head", so every device of a tensor split holds the whole
latent and attends its own query heads over it). The `mla` block attends in absorbed
form: queries in latent space against the latent keys, whose first kv_lora_rank entries
are also the values (the decode door's v_cache=None, value_dim).
"""

import jax.numpy as jnp
from flax import struct

from jaxpar import pallas_kernels
from jaxpar.models import kv_cache


def init_pages(cfg, num_layers: int, num_pages: int, page_size: int, dtype) -> dict:
  """A zeroed stacked latent cache {"latent": [num_layers, 1, num_pages, page_size, latent + rope]}."""
  return {"latent": jnp.zeros((num_layers, 1, num_pages, page_size, cfg.mla.latent_dim), dtype)}


@struct.dataclass
class LatentPagedCache:
  """One layer's view of its group's stacked latent pages, each row's page table
  [B, pages_per_seq] and this layer's index."""
  stores_latent = True  # its pages hold latents: the mla block attends to them in absorbed form
  pages: dict
  page_table: jnp.ndarray
  layer: jnp.ndarray

  def at(self, layer) -> "LatentPagedCache":
    return self.replace(layer=layer)

  def update_and_attend(self, q, k, v, context, spec, sinks=None):
    """q [B, T, heads, latent + rope] (absorbed queries); k [B, T, 1, latent + rope] the
    new tokens' latent and rotated key; v [B, T, 1, latent] their values, which are k's
    first entries (spec.value_dim of them): only k is stored; sinks [heads] or None
    -> (out [B, T, heads, latent], cache)."""
    pages = kv_cache.scatter(self.pages["latent"], self.layer, self.page_table, k, context.positions)
    cache = self.replace(pages={"latent": pages})
    out = pallas_kernels.paged_attention(q, pages, None, context.positions, self.page_table,
                                         context.attention_spec(spec), layer=self.layer, sinks=sinks)
    return out, cache


def bytes_per_token(cfg, dtype) -> int:
  """Latent-cache bytes one token takes across all layers."""
  return cfg.num_layers * cfg.mla.latent_dim * jnp.dtype(dtype).itemsize
