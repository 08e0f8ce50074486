"""Grouped-query self-attention with RoPE and optional qk-norm (Qwen3)."""

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar import pallas_kernels
from jaxpar.mesh import constrain
from jaxpar.models import kv_cache, kv_cache_quantized, kv_quant
from jaxpar.models.dense import dense, projection
from jaxpar.models.init import fan_in
from jaxpar.models.norm import RMSNorm
from jaxpar.models.rope import apply_rope


class Attention(nnx.Module):
  """Causal GQA over [B, L, embed] -> [B, L, embed].

  Parameters: q [embed, heads, head_dim], k and v [embed, kv_heads, head_dim],
  o [heads, head_dim, embed] (each a QuantizedKernel under model.quantization); optional
  q/k/v biases (Qwen2) and q/k RMSNorms (Qwen3).
  Without a cache it attends within each packed segment; with one it first writes the
  new keys and values into the cache's pages and attends to everything cached up to
  each query's position.
  """

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    e, h, kv, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    proj_init = fan_in(in_axis=0, out_axis=(1, 2))
    proj = dict(param_dtype=param_dtype, quantization=cfg.quantization)
    self.q = projection(proj_init, rngs.params(), (e, h, d), ("embed", "heads", "head_dim"), **proj)
    self.k = projection(proj_init, rngs.params(), (e, kv, d), ("embed", "kv_heads", "head_dim"), **proj)
    self.v = projection(proj_init, rngs.params(), (e, kv, d), ("embed", "kv_heads", "head_dim"), **proj)
    self.o = projection(fan_in(in_axis=(0, 1), out_axis=2), rngs.params(), (h, d, e),
                        ("heads", "head_dim", "embed"), contract=2, **proj)
    if cfg.attention_bias:
      self.q_bias = nnx.Param(jnp.zeros((h, d), param_dtype), out_sharding=("heads", "head_dim"))
      self.k_bias = nnx.Param(jnp.zeros((kv, d), param_dtype), out_sharding=("kv_heads", "head_dim"))
      self.v_bias = nnx.Param(jnp.zeros((kv, d), param_dtype), out_sharding=("kv_heads", "head_dim"))
    self.use_bias = cfg.attention_bias
    if cfg.qk_norm:
      norm = dict(eps=cfg.norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype,
                  names=("head_dim",))
      self.q_norm, self.k_norm = RMSNorm(d, **norm), RMSNorm(d, **norm)
    else:
      self.q_norm = self.k_norm = None
    self.implementation = cfg.attention
    self.dtype = compute_dtype

  def __call__(self, x, context, cache=None):
    """x [B, L, embed] -> ([B, L, embed], cache)."""
    dt = self.dtype
    q, k, v = (checkpoint_name(dense(x, w, dtype=dt), "qkv_proj") for w in (self.q, self.k, self.v))
    if self.use_bias:
      q, k, v = (q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt),
                 v + self.v_bias[...].astype(dt))
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    positions = context.positions
    q = constrain(apply_rope(q, positions, context.inv_freq), ("batch", "length", "act_heads", "head_dim"))
    k = constrain(apply_rope(k, positions, context.inv_freq), ("batch", "length", "act_kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "act_kv_heads", "head_dim"))
    if cache is None and context.kv_quantization is not None:
      out = kv_quant.cached_attention(q, k, v, context.kv_quantization, context.segment_ids)
    elif cache is None:
      out = pallas_kernels.attention(q, k, v, causal=True, segment_ids=context.segment_ids,
                                     implementation=self.implementation, zigzag=context.zigzag)
    elif context.kv_quantization is not None:
      spec, rows = context.kv_quantization, context.tail_index
      cache = kv_cache_quantized.write(cache, k, v, positions, context.page_table, rows, spec)
      k_pages, v_pages, table = kv_cache_quantized.read(cache, context.page_table, rows,
                                                        jnp.max(positions, axis=1), spec, dt)
      out = pallas_kernels.paged_attention(q, k_pages, v_pages, positions, table,
                                           implementation=self.implementation)
    else:
      cache = kv_cache.write(cache, k, v, positions, context.page_table)
      k_pages, v_pages = cache.keys_values()
      out = pallas_kernels.paged_attention(q, k_pages, v_pages, positions, context.page_table,
                                           implementation=self.implementation)
    out = checkpoint_name(out, "attention_out")
    return checkpoint_name(dense(out, self.o, contract=2, dtype=dt), "out_proj"), cache
