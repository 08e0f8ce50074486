"""Grouped-query self-attention with RoPE and optional qk-norm (Qwen3): the `gqa` block."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.mesh import constrain
from jaxpar.models import kv_cache, kv_cache_quantized, lora
from jaxpar.models import low_precision_delayed as delayed
from jaxpar.models.dense import dense, projection
from jaxpar.models.init import fan_in
from jaxpar.models.norm import RMSNorm
from jaxpar.models.registry import register_block
from jaxpar.models.rope import apply_rope


class Attention(nnx.Module):
  """Causal GQA over [B, L, embed] -> [B, L, embed].

  Parameters: q [embed, heads, head_dim], k and v [embed, kv_heads, head_dim],
  o [heads, head_dim, embed] (each a QuantizedKernel under model.quantization; with
  model.lora, their adapters in `lora`, models/lora.py); optional q/k/v biases (Qwen2),
  an o bias [embed] (GPT-OSS), q/k RMSNorms (Qwen3), sinks [heads] (GPT-OSS) and an output
  gate [embed, heads, head_dim] (Qwen3-Next, Qwen3.5: the attention output times its sigmoid).
  A subclass with `values_are_keys` has no v: the values are the keys as projected, before
  any norm or RoPE (Gemma 4's global layers).
  The layer's options (layer_pattern.LayerOptions) give its RoPE and its attention options;
  the cache object (models/caches.py) decides where keys and values come from: the same
  call trains, measures KV quantization, prefills and decodes.
  """

  values_are_keys = False

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    e, h, kv, d = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    proj_init = fan_in(in_axis=0, out_axis=(1, 2))
    proj = dict(param_dtype=param_dtype, quantization=cfg.quantization)
    self.q = projection(proj_init, rngs.params(), (e, h, d), ("embed", "heads", "head_dim"), **proj)
    self.k = projection(proj_init, rngs.params(), (e, kv, d), ("embed", "kv_heads", "head_dim"), **proj)
    self.v = (None if self.values_are_keys else
              projection(proj_init, rngs.params(), (e, kv, d), ("embed", "kv_heads", "head_dim"), **proj))
    self.o = projection(fan_in(in_axis=(0, 1), out_axis=2), rngs.params(), (h, d, e),
                        ("heads", "head_dim", "embed"), contract=2, **proj)
    kernels = dict(q=self.q, k=self.k, v=self.v, o=self.o)
    self.lora = lora.adapters(cfg.lora, rngs, **{n: p for n, p in kernels.items() if p is not None})
    self.gate = (projection(proj_init, rngs.params(), (e, h, d), ("embed", "heads", "head_dim"), **proj)
                 if cfg.attention_output_gate else None)
    if cfg.attention_bias:
      self.q_bias = nnx.Param(jnp.zeros((h, d), param_dtype), out_sharding=("heads", "head_dim"))
      self.k_bias = nnx.Param(jnp.zeros((kv, d), param_dtype), out_sharding=("kv_heads", "head_dim"))
      self.v_bias = nnx.Param(jnp.zeros((kv, d), param_dtype), out_sharding=("kv_heads", "head_dim"))
    self.use_bias = cfg.attention_bias
    self.o_bias = (nnx.Param(jnp.zeros((e,), param_dtype), out_sharding=("embed",), weight_decay=False)
                   if cfg.attention_out_bias else None)
    if cfg.qk_norm:
      norm = dict(eps=cfg.norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype,
                  names=("head_dim",), unit_offset=cfg.norm_unit_offset)
      self.q_norm, self.k_norm = RMSNorm(d, **norm), RMSNorm(d, **norm)
    else:
      self.q_norm = self.k_norm = None
    # Not decayed: a sink is a logit offset, as a norm scale is a gain.
    self.sinks = (nnx.Param(jnp.zeros((h,), param_dtype), out_sharding=("heads",), weight_decay=False)
                  if cfg.attention_sinks else None)
    self.dtype, self.precision = compute_dtype, cfg.train_precision
    for name in ("q", "k", "v", "o", "gate"):  # fp8_delayed's scaling histories
      if getattr(self, name) is not None:
        setattr(self, f"{name}_{delayed.NAME}", delayed.amax_history(cfg.train_precision, cfg.fp8_amax_history))

  def _history(self, name):
    return getattr(self, f"{name}_{delayed.NAME}", None)

  def __call__(self, x, context, cache, options):
    """x [B, L, embed] -> ([B, L, embed], cache)."""
    dt = self.dtype
    q, k, v = self.project_qkv(x)
    q, k = self.embed_positions(q, k, context.sequence_positions, options.rope)
    q = constrain(q, ("batch", "length", "act_heads", "head_dim"))
    k = constrain(k, ("batch", "length", "act_kv_heads", "head_dim"))
    v = constrain(v, ("batch", "length", "act_kv_heads", "head_dim"))
    sinks = None if self.sinks is None else self.sinks[...].astype(jnp.float32)
    out, cache = cache.update_and_attend(q, k, v, context, options.attention, sinks=sinks)
    if self.gate is not None:
      out = out * jax.nn.sigmoid(dense(x, self.gate, dtype=dt, precision=self.precision,
                                       history=self._history("gate")))
    out = checkpoint_name(out, "attention_out")
    o = dense(out, self.o, contract=2, dtype=dt, adapter=lora.adapter(self.lora, "o"), precision=self.precision,
              history=self._history("o"))
    if self.o_bias is not None:
      o = o + self.o_bias[...].astype(dt)
    return checkpoint_name(o, "out_proj"), cache

  def project(self, x, name: str):
    """x [B, L, embed] through projection `name` (q, k or v) -> [B, L, heads, head_dim]."""
    return checkpoint_name(dense(x, getattr(self, name), dtype=self.dtype, adapter=lora.adapter(self.lora, name),
                                 precision=self.precision, history=self._history(name)), "qkv_proj")

  def project_qkv(self, x):
    """q, k, v [B, L, heads, head_dim] before RoPE: projected, biased and normed."""
    q, k = self.project(x, "q"), self.project(x, "k")
    v = k if self.v is None else self.project(x, "v")
    if self.use_bias:
      dt = self.dtype
      q, k, v = (q + self.q_bias[...].astype(dt), k + self.k_bias[...].astype(dt),
                 v + self.v_bias[...].astype(dt))
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v

  @staticmethod
  def layer_config(cfg):
    """The model section as this block's layers see it (a block with heads of its own
    width says so: Gemma 4's global layers)."""
    return cfg

  @staticmethod
  def matmul_params(cfg) -> int:
    """Parameters of its projections (what FLOP counting multiplies by tokens)."""
    gated = cfg.num_heads if cfg.attention_output_gate else 0
    return cfg.embed_dim * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads + gated)

  @staticmethod
  def head_dims(cfg) -> tuple[int, int]:
    """(q/k, v) entries per head: the scores' and the values' matmul widths."""
    return cfg.head_dim, cfg.head_dim

  @staticmethod
  def init_cache(cfg, num_layers: int, num_pages: int, page_size: int, dtype, *, kv_quantization=None,
                 slots: int = 1) -> dict:
    """A generation cache for a group of these layers: float pages, or quantized ones with a
    float tail page per slot (models/caches.py says how caches are used)."""
    if kv_quantization is None:
      return kv_cache.init_pages(cfg, num_layers, num_pages, page_size, dtype)
    return kv_cache_quantized.init(cfg, num_layers, num_pages, page_size, slots, kv_quantization, dtype)

  def embed_positions(self, q, k, positions, rope):
    """Rotate q and k [B, L, H, D] by their positions (rope: a layer_pattern.Rope, or None
    for a layer without position embedding)."""
    if rope is None:
      return q, k
    inv_freq, factor = rope.frequencies(q.shape[-1]), rope.attention_factor()
    return apply_rope(q, positions, inv_freq, factor), apply_rope(k, positions, inv_freq, factor)


register_block("attention", "gqa", Attention)
