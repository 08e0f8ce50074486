"""Grouped-query self-attention with RoPE and optional qk-norm (Qwen3)."""

import jax.numpy as jnp
from flax import nnx

from jaxpar import pallas_kernels
from jaxpar.mesh import constrain
from jaxpar.models import kv_cache
from jaxpar.models.dense import dense
from jaxpar.models.init import fan_in
from jaxpar.models.norm import RMSNorm
from jaxpar.models.rope import apply_rope


class Attention(nnx.Module):
  """Causal GQA over [B, L, embed] -> [B, L, embed].

  Parameters: q [embed, heads, head_dim], k and v [embed, kv_heads, head_dim],
  o [heads, head_dim, embed]; optional q/k/v biases (Qwen2) and q/k RMSNorms (Qwen3).
  Without a cache it attends within each packed segment; with one it first writes the
  new keys and values into the cache's pages and attends to everything cached up to
  each query's position.
  """

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    e, h, kv, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    proj_init = fan_in(in_axis=0, out_axis=(1, 2))
    self.q = nnx.Param(proj_init(rngs.params(), (e, h, d), param_dtype),
                       out_sharding=("embed", "heads", "head_dim"))
    self.k = nnx.Param(proj_init(rngs.params(), (e, kv, d), param_dtype),
                       out_sharding=("embed", "kv_heads", "head_dim"))
    self.v = nnx.Param(proj_init(rngs.params(), (e, kv, d), param_dtype),
                       out_sharding=("embed", "kv_heads", "head_dim"))
    self.o = nnx.Param(fan_in(in_axis=(0, 1), out_axis=2)(rngs.params(), (h, d, e), param_dtype),
                       out_sharding=("heads", "head_dim", "embed"))
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
    self.context_parallel = cfg.context_parallel
    self.dtype = compute_dtype

  def __call__(self, x, context, cache=None):
    """x [B, L, embed] -> ([B, L, embed], cache)."""
    dt = self.dtype
    q = dense(x, self.q[...].astype(dt))
    k = dense(x, self.k[...].astype(dt))
    v = dense(x, self.v[...].astype(dt))
    if self.use_bias:
      q, k, v = (q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt),
                 v + self.v_bias[...].astype(dt))
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    positions = context.positions
    q = constrain(apply_rope(q, positions, context.inv_freq), ("batch", "length", "act_heads", "head_dim"))
    k = constrain(apply_rope(k, positions, context.inv_freq), ("batch", "length", "act_kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "act_kv_heads", "head_dim"))
    if cache is None:
      out = pallas_kernels.attention(q, k, v, causal=True, segment_ids=context.segment_ids,
                                     implementation=self.implementation,
                                     context_parallel=self.context_parallel, zigzag=context.zigzag)
    else:
      cache = kv_cache.write(cache, k, v, positions, context.page_table)
      out = pallas_kernels.paged_attention(q, cache["k"], cache["v"], positions, context.page_table,
                                           implementation=self.implementation)
    return dense(out, self.o[...].astype(dt), contract=2), cache
