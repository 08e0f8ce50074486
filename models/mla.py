"""Multi-head latent attention (DeepSeek-V2/V3): the `mla` attention block.

Keys and values of all heads are expanded from one small latent per token (`kv_lora_rank`)
plus a rotated part shared by all heads (`qk_rope_head_dim`), so a generation cache need
hold only those (models/kv_cache_latent.py). The block has two forms of one function:

- expanded (training, full forwards): per-head keys [nope + rope] and values [v_head_dim]
  go through the attention door, whose kernels take a value head dim unlike q/k's;
- absorbed (decode through a latent cache): the key expansion is folded into the query
  (q_nope . W_uk per head gives a query in latent space) and the value expansion applied
  after attention, so every head attends straight over the cached latents: one "kv head"
  of latent + rope entries whose first kv_lora_rank entries are also the values.
"""

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.errors import ConfigError
from jaxpar.mesh import constrain
from jaxpar.models.dense import dense, projection
from jaxpar.models.init import fan_in
from jaxpar.models import kv_cache_latent
from jaxpar.models.norm import RMSNorm
from jaxpar.models.registry import register_block
from jaxpar.models.rope import apply_rope, softmax_mscale


def apply_rope_interleaved(x, positions, inv_freq, factor: float = 1.0):
  """x: [B, L, H, D] rotated in adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's layout);
  the result is in the two-halves order [evens, odds], as HF computes it: the dot product
  of two such vectors is what it would be in the interleaved order."""
  halves = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  return apply_rope(halves, positions, inv_freq, factor)


class MLAttention(nnx.Module):
  """[B, L, embed] -> [B, L, embed].

  Parameters: q [embed, heads, qk] or q_a [embed, q_lora] -> q_norm -> q_b [q_lora, heads,
  qk]; kv_a [embed, kv_lora + rope] (the latent and the shared key part) -> kv_norm (on
  the latent) -> kv_b [kv_lora, heads, nope + v]; o [heads, v, embed]. qk = nope + rope.
  """

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    m = getattr(cfg, "mla", None)
    if m is None:
      raise ConfigError(f"model.attention_block=mla needs a family with a model.mla section (deepseek), "
                        f"not model.family={cfg.family}")
    if cfg.quantization is not None:
      raise ConfigError("model.quantization with model.attention_block=mla is not supported yet: "
                        "keep the latent projections float")
    if cfg.train_precision != "compute_dtype":
      raise ConfigError(f"model.train_precision={cfg.train_precision} does not reach the latent "
                        "projections of model.attention_block=mla yet: train with model.train_precision=compute_dtype")
    self.mla, e, h = m, cfg.embed_dim, cfg.num_heads
    init = lambda shape, names, in_axis=0, out_axis=-1: projection(  # noqa: E731
        fan_in(in_axis, out_axis), rngs.params(), shape, names, param_dtype=param_dtype)
    norm = dict(eps=m.latent_norm_eps, param_dtype=param_dtype, compute_dtype=compute_dtype)
    heads = ("heads", "head_dim")
    if m.q_lora_rank is None:
      self.q = init((e, h, m.qk_head_dim), ("embed", *heads), out_axis=(1, 2))
    else:
      self.q_a = init((e, m.q_lora_rank), ("embed", "q_lora"))
      self.q_norm = RMSNorm(m.q_lora_rank, names=("q_lora",), **norm)
      self.q_b = init((m.q_lora_rank, h, m.qk_head_dim), ("q_lora", *heads), out_axis=(1, 2))
    self.kv_a = init((e, m.latent_dim), ("embed", "kv_lora"))
    self.kv_norm = RMSNorm(m.kv_lora_rank, names=("kv_lora",), **norm)
    self.kv_b = init((m.kv_lora_rank, h, m.qk_nope_head_dim + m.v_head_dim), ("kv_lora", *heads), out_axis=(1, 2))
    self.o = projection(fan_in(in_axis=(0, 1), out_axis=2), rngs.params(), (h, m.v_head_dim, e),
                        ("heads", "head_dim", "embed"), param_dtype=param_dtype, contract=2)
    self.dtype = compute_dtype

  def __call__(self, x, context, cache, options):
    m, dt = self.mla, self.dtype
    if m.q_lora_rank is None:
      q = dense(x, self.q, dtype=dt)
    else:
      q = dense(self.q_norm(dense(x, self.q_a, dtype=dt)), self.q_b, dtype=dt)
    q = checkpoint_name(q, "qkv_proj")
    latent, k_rope = jnp.split(checkpoint_name(dense(x, self.kv_a, dtype=dt), "qkv_proj"), [m.kv_lora_rank], -1)
    latent = self.kv_norm(latent)
    q_nope, q_rope = jnp.split(q, [m.qk_nope_head_dim], -1)
    q_rope, k_rope = self.embed_positions(q_rope, k_rope[:, :, None, :], context.sequence_positions, options.rope)
    # Scores are over q/k's head dim whatever form they are computed in (times YaRN's mscale).
    mscale = softmax_mscale(options.rope and options.rope.scaling)
    spec = options.attention.replace(scale=(options.attention.scale or m.qk_head_dim ** -0.5) * mscale)
    w_uk, w_uv = jnp.split(self.kv_b[...].astype(dt), [m.qk_nope_head_dim], -1)
    if cache.stores_latent:
      out, cache = self._absorbed(q_nope, q_rope, latent, k_rope, w_uk, w_uv, context, cache, spec)
    else:
      k_nope, v = jnp.split(dense(latent, self.kv_b, dtype=dt), [m.qk_nope_head_dim], -1)
      k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], m.qk_rope_head_dim))], -1)
      q = constrain(jnp.concatenate([q_nope, q_rope], -1), ("batch", "length", "act_heads", "head_dim"))
      k = constrain(k, ("batch", "length", "act_heads", "head_dim"))
      v = constrain(v, ("batch", "length", "act_heads", "head_dim"))
      out, cache = cache.update_and_attend(q, k, v, context, spec)
    out = checkpoint_name(out, "attention_out")
    return checkpoint_name(dense(out, self.o, contract=2, dtype=dt), "out_proj"), cache

  def _absorbed(self, q_nope, q_rope, latent, k_rope, w_uk, w_uv, context, cache, spec):
    """Attention over the latent cache: queries [B, T, heads, kv_lora + rope] against one
    key per token (latent + rotated part) whose latent is also the value; the value
    expansion W_uv comes after."""
    q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w_uk)
    q = constrain(jnp.concatenate([q_latent, q_rope], -1), ("batch", "length", "act_heads", "head_dim"))
    key = jnp.concatenate([latent, k_rope[:, :, 0]], -1)[:, :, None, :]
    spec = spec.replace(value_dim=latent.shape[-1])  # the keys' first entries are the values
    out, cache = cache.update_and_attend(q, key, latent[:, :, None, :], context, spec)
    return jnp.einsum("bthc,chv->bthv", out, w_uv), cache

  @staticmethod
  def matmul_params(cfg) -> int:
    """Its projections: q (through its latent), the kv latent and rotary key, the per-head
    key/value expansion, the output."""
    m, e, h = cfg.mla, cfg.embed_dim, cfg.num_heads
    q = e * h * m.qk_head_dim if m.q_lora_rank is None else m.q_lora_rank * (e + h * m.qk_head_dim)
    return q + e * m.latent_dim + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * e

  @staticmethod
  def head_dims(cfg) -> tuple[int, int]:
    return cfg.mla.qk_head_dim, cfg.mla.v_head_dim

  @staticmethod
  def init_cache(cfg, num_layers: int, num_pages: int, page_size: int, dtype, *, kv_quantization=None,
                 slots: int = 1) -> dict:
    """The latent cache (models/kv_cache_latent.py), float."""
    if kv_quantization is not None:
      raise ConfigError(f"kv_cache={kv_quantization.mode} with model.attention_block=mla is not supported: "
                        "the latent cache is not quantized; serve it float (kv_cache: float)")
    return kv_cache_latent.init_pages(cfg, num_layers, num_pages, page_size, dtype)

  def embed_positions(self, q, k, positions, rope):
    """Rotate the rotary parts q [B, L, H, rope], k [B, L, 1, rope] (rope None: a NoPE layer)."""
    if rope is None:
      return q, k
    inv_freq, factor = rope.frequencies(q.shape[-1]), rope.attention_factor()  # factor: YaRN's
    rotate = apply_rope_interleaved if self.mla.rope_interleave else apply_rope
    return rotate(q, positions, inv_freq, factor), rotate(k, positions, inv_freq, factor)


register_block("attention", "mla", MLAttention)
