"""KV-cache quantization over the paged layout: int8 per token, KIVI 4/2-bit (keys per
channel over a page, values per token), error bounds, bytes, and the attention a decode
step computes through such a cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import pallas_kernels
from jaxpar.models import kv_quant
from jaxpar.models.kv_quant import KVQuantization

HEADS, PAGES, PAGE, DIM = 2, 6, 16, 64


def _pages(seed=0, outlier_channels=()):
  k, v = jax.random.normal(jax.random.key(seed), (2, HEADS, PAGES, PAGE, DIM))
  for c in outlier_channels:  # keys: a few channels much larger than the rest (as in LLMs)
    k = k.at[..., c].multiply(20.0).at[..., c].add(30.0)
  return k, v


@pytest.mark.parametrize("mode", kv_quant.KV_MODES)
def test_round_trip_within_half_a_step_and_layout(mode):
  spec = KVQuantization(mode)
  k, v = _pages()
  stored = kv_quant.quantize_pages(k, v, spec)
  k_back, v_back = kv_quant.dequantize_pages(stored, spec)
  bits = spec.bits
  per_byte = 8 // bits
  assert stored["k"]["q"].shape == (HEADS, PAGES, PAGE, DIM // per_byte) == stored["v"]["q"].shape
  # int8: per token; KIVI: keys per channel (one scale per page and channel), values per token.
  # Per-token scales are stored as a row per page (the TPU decode kernel reads them so).
  key_scale = (HEADS, PAGES, 1, PAGE) if mode == "int8" else (HEADS, PAGES, 1, DIM)
  assert stored["k"]["scale"].shape == key_scale
  assert stored["v"]["scale"].shape == (HEADS, PAGES, 1, PAGE)
  assert ("zero" in stored["k"]) == (mode != "int8")
  levels = 2 ** bits
  for x, back, part, per_token in ((k, k_back, stored["k"], mode == "int8"), (v, v_back, stored["v"], True)):
    column = (lambda a: jnp.swapaxes(a, -1, -2)) if per_token else (lambda a: a)  # noqa: E731
    scale = column(part["scale"].astype(jnp.float32))
    zero = jnp.abs(column(part.get("zero", jnp.zeros((1, 1), jnp.bfloat16)).astype(jnp.float32)))
    # half a step, plus bf16 rounding (2^-9 relative) of the scale and the zero point
    bound = scale * (0.5 + 2.0 ** -8 * (levels + 2 * zero))
    assert bool(jnp.all(jnp.abs(back - x) <= bound))


@pytest.mark.parametrize("mode,ratio", [("int8", 0.5), ("int4", 0.25), ("int2", 0.125)])
def test_bytes_against_bf16_pages(mode, ratio):
  """Bytes measured on the arrays: the packed values are exactly `ratio` of bf16 pages; the
  bf16 scales and zero points add the rest (per token, or per page and channel)."""
  spec = KVQuantization(mode)
  k, v = (x.astype(jnp.bfloat16) for x in _pages())
  stored = kv_quant.quantize_pages(k, v, spec)
  float_bytes = k.nbytes + v.nbytes
  values = stored["k"]["q"].nbytes + stored["v"]["q"].nbytes
  assert values == float_bytes * ratio
  tokens = HEADS * PAGES * PAGE
  extra = (tokens * 2 * 2 if mode == "int8" else  # a scale per token for k and v
           tokens * 4 + HEADS * PAGES * DIM * 4)  # v: scale+zero per token; k: per page channel
  assert kv_quant.nbytes(stored) == values + extra
  assert kv_quant.nbytes(stored) / float_bytes < ratio + 0.13


def test_kivi_keys_per_channel_beat_per_token_on_outlier_channels():
  """Why keys are quantized per channel: with outlier channels, 2-bit per-token keys lose
  the ordinary channels; per-channel scales keep them."""
  spec = KVQuantization("int2")
  k, v = _pages(outlier_channels=(3, 40))
  per_channel = kv_quant.dequantize_pages(kv_quant.quantize_pages(k, v, spec), spec)[0]
  # Per token: the values' rule applied to keys.
  per_token = kv_quant.dequantize_pages(kv_quant.quantize_pages(v, k, spec), spec)[1]
  normal = np.ones(DIM, bool)
  normal[[3, 40]] = False
  err = lambda back: float(jnp.abs(back - k)[..., normal].mean())
  assert err(per_channel) < err(per_token) / 4


def test_sealed_pages_leave_a_window_of_newest_tokens_in_float():
  spec = KVQuantization("int4", page_size=16, window=32)
  pos = jnp.arange(256)
  sealed = kv_quant.sealed(pos[:, None], pos[None, :], spec) & (pos[None, :] <= pos[:, None])
  floats = (pos[None, :] <= pos[:, None]).sum(1) - sealed.sum(1)
  # Query t reads its newest >= 32 tokens in float (fewer only at the start), never > 32 + 15.
  assert bool(jnp.all(floats == jnp.minimum(pos + 1, floats)))
  assert int(floats[64:].min()) == 32 and int(floats.max()) == 47


def test_cached_attention_is_the_reference_when_nothing_is_sealed():
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(kq, (2, 64, 4, 32))
  k, v = jax.random.normal(kk, (2, 64, 2, 32)), jax.random.normal(kv, (2, 64, 2, 32))
  want = pallas_kernels.attention_reference(q, k, v)
  run = jax.jit(kv_quant.cached_attention, static_argnums=3)
  got = run(q, k, v, KVQuantization("int2", page_size=16, window=64))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  errors = [float(jnp.abs(run(q, k, v, KVQuantization(m, 16, 16)) - want).max())
            for m in kv_quant.KV_MODES]
  assert 0 < errors[0] < errors[1] < errors[2]  # fewer bits, more error; int8 still not exact


def test_bad_options_name_the_option():
  with pytest.raises(ValueError, match="mode='int3' is not one of"):
    KVQuantization("int3")
  with pytest.raises(ValueError, match="window=-1"):
    KVQuantization("int4", window=-1)
  q = jnp.ones((1, 40, 2, 16))
  with pytest.raises(ValueError, match="sequence length 40 must be a multiple of page_size=16"):
    kv_quant.cached_attention(q, q, q, KVQuantization("int8"))
  with pytest.raises(ValueError, match="unpacked sequences"):
    kv_quant.cached_attention(q, q, q, KVQuantization("int8"), segment_ids=jnp.ones((1, 40), jnp.int32))
