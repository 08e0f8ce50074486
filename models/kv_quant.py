"""Quantized KV-cache pages: int8, and KIVI's 4-bit and 2-bit (Liu et al., 2024).

Works on the paged layout of `kv_cache.py`, [..., page_size, head_dim] per kv head and page:
- int8: keys and values per token (one scale per token and head, symmetric).
- int4 / int2 (KIVI): keys per channel (one scale and zero point per channel over a page's
  tokens: key outliers sit in fixed channels), values per token (scale and zero point over
  head_dim), asymmetric. A page is KIVI's quantization group along tokens, so keys can be
  quantized only once their page is complete.
- A full-precision window: the newest `window` tokens stay in float; a page is quantized
  ("sealed") once all its tokens are older than that (KIVI's residual, page-aligned).

Values are packed along head_dim (two or four per byte, `pallas_kernels.matmul.packing`).
A page's per-token scales and zero points are stored as a row [..., 1, page_size], not a
column [..., page_size, 1]: the TPU decode kernel reads them so, and on a TPU a column is a
different tiled layout, which XLA would copy the whole pool of to turn into a row, every layer
of every step.
Every element is within half a quantization step of its float value, plus the bfloat16
rounding of its scale and zero point (2^-9 relative). How the engine stores sealed and
open pages is the engine's business; these
functions define what a quantized page holds and what a decode step reads back.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError, UserError
from jaxpar.pallas_kernels.attention import reference
from jaxpar.pallas_kernels.attention.spec import AttentionSpec
from jaxpar.pallas_kernels.matmul import packing
from jaxpar.pallas_kernels.matmul.quantize import quantize_int

KV_MODES = ("int8", "int4", "int2")
# Scales and zero points are stored in bfloat16 (KIVI keeps fp16): they add 2 bytes per
# token and head (values; int8 keys) or 2 bytes per page, channel and head (KIVI keys).
SCALE_DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class KVQuantization:
  """mode: int8 | int4 | int2; page_size: tokens per page (KIVI's key group); window: newest
  tokens kept in float (int8 needs none: 0 is fine)."""
  mode: str
  page_size: int = 16
  window: int = 32

  def __post_init__(self):
    if self.mode not in KV_MODES:
      raise ConfigError(f"kv cache mode={self.mode!r} is not one of {KV_MODES}")
    if self.page_size < 1 or self.window < 0:
      raise ConfigError(f"page_size={self.page_size} must be >= 1 and window={self.window} >= 0")

  @property
  def bits(self) -> int:
    return int(self.mode[3:])


def _quantize(x, bits: int, axis: int) -> dict:
  """One page tensor [..., S, D] -> {"q": packed int8 [..., S, D * bits / 8], "scale",
  "zero"}; x ~ (q - zero) * scale. int8: symmetric (the stored byte is q + 128, zero 128).
  Per token (axis -1) the scale and zero are stored as rows [..., 1, S]."""
  symmetric = bits == 8
  q, scale, zero = quantize_int(x, bits, axis, symmetric=symmetric)
  bias = 2 ** (bits - 1) if symmetric else 0
  stored = (lambda a: jnp.swapaxes(a, -1, -2)) if axis == -1 else (lambda a: a)  # noqa: E731
  out = {"q": packing.pack(q + bias, bits, axis=-1, group=x.shape[-1]),
         "scale": stored(scale).astype(SCALE_DTYPE)}
  if not symmetric:
    out["zero"] = stored(zero).astype(SCALE_DTYPE)
  return out


def _dequantize(stored: dict, bits: int, axis: int):
  """`_quantize`'s inverse for values quantized along `axis` (-1: per token, the scale and
  zero stored as rows, back to columns here)."""
  q = packing.unpack(stored["q"], bits, axis=-1, group=stored["q"].shape[-1] * 8 // bits)
  column = (lambda a: jnp.swapaxes(a, -1, -2)) if axis == -1 else (lambda a: a)  # noqa: E731
  zero = column(stored["zero"]).astype(jnp.float32) if "zero" in stored else 2 ** (bits - 1)
  return (q - zero) * column(stored["scale"]).astype(jnp.float32)


def quantize_pages(k_pages, v_pages, spec: KVQuantization) -> dict:
  """Float pages [..., page_size, head_dim] -> {"k": {...}, "v": {...}} (see module doc)."""
  return {"k": _quantize(k_pages, spec.bits, _key_axis(spec)), "v": _quantize(v_pages, spec.bits, -1)}


def _key_axis(spec: KVQuantization) -> int:
  return -1 if spec.mode == "int8" else -2  # KIVI: keys per channel over the page


def dequantize_pages(stored: dict, spec: KVQuantization, dtype=jnp.float32):
  """-> (k_pages, v_pages) in `dtype`, as a decode step reads them."""
  return tuple(_dequantize(stored[name], spec.bits, axis).astype(dtype)
               for name, axis in (("k", _key_axis(spec)), ("v", -1)))


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def sealed(query_pos, key_pos, spec: KVQuantization):
  """Whether the key at key_pos is read quantized by the query at query_pos: its page is
  complete and wholly older than the query's newest `window` tokens."""
  page_end = (key_pos // spec.page_size + 1) * spec.page_size
  return page_end <= query_pos + 1 - spec.window


def _as_pages(x, page_size):
  """[B, L, H, D] -> [B, H, L / page_size, page_size, D]."""
  b, l, h, d = x.shape
  return jnp.moveaxis(x.reshape(b, l // page_size, page_size, h, d), 3, 1)


def _from_pages(x):
  b, h, p, s, d = x.shape
  return jnp.moveaxis(x, 1, 3).reshape(b, p * s, h, d)


def cached_attention(q, k, v, spec: KVQuantization, attention: AttentionSpec = AttentionSpec(), segment_ids=None, *, sinks=None):
  """Causal attention as a decode step reads a quantized paged cache, for every query of a
  full forward at once: query t sees the keys/values of sealed pages (for t) dequantized
  and the rest in float, exactly the cache's content when token t is decoded.

  q [B, L, Hq, D]; k, v [B, L, Hkv, D] with L a multiple of page_size -> [B, L, Hq, D].
  Sequences are unpacked (a token's position is its index), as a cache holds them.
  attention (the layer's AttentionSpec: mask, soft cap, scale) and sinks: as
  `pallas_kernels.attention` takes them.
  """
  b, l, hq, d = q.shape
  hkv = k.shape[2]
  if segment_ids is not None:
    raise UserError("a quantized KV cache holds one sequence per row: evaluate unpacked "
                     "sequences (segment_ids=None)")
  if l % spec.page_size:
    raise UserError(f"sequence length {l} must be a multiple of page_size={spec.page_size}")
  k_q, v_q = dequantize_pages(quantize_pages(_as_pages(k, spec.page_size), _as_pages(v, spec.page_size),
                                             spec), spec, k.dtype)
  k_q, v_q = _from_pages(k_q), _from_pages(v_q)
  group = hq // hkv
  qg = q.reshape(b, l, hkv, group, d).astype(jnp.float32) * attention.scale_for(d)
  cap = attention.logit_soft_cap
  cap = (lambda x: x) if cap is None else (lambda x, cap=cap: cap * jnp.tanh(x / cap))
  scores = lambda keys: cap(jnp.einsum("bqhgd,bkhd->bhgqk", qg, keys.astype(jnp.float32)))
  pos = jnp.arange(l)
  use_q = sealed(pos[:, None], pos[None, :], spec)
  logits = jnp.where(use_q, scores(k_q), scores(k))
  visible = (pos[None, :] <= pos[:, None]) & reference.visible(attention.mask, pos[:, None], pos[None, :])
  logits = jnp.where(visible, logits, -1e30)
  if sinks is not None:  # one more column per row, of value zero: dropped after the softmax
    column = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, group, 1, 1), logits.shape[:-1] + (1,))
    logits = jnp.concatenate([logits, column], axis=-1)
  probs = jax.nn.softmax(logits, axis=-1)[..., :l]
  mix = lambda p, values: jnp.einsum("bhgqk,bkhd->bqhgd", p, values.astype(jnp.float32))
  out = mix(jnp.where(use_q, probs, 0.0), v_q) + mix(jnp.where(use_q, 0.0, probs), v)
  return out.reshape(b, l, hq, d).astype(q.dtype)
