"""The decoder model (llama family): layer stacking, remat, masking, RoPE, dtypes."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig, RopeScaling
from jaxpar.models.config import REMAT_NAMES
from jaxpar.models import build_model
from jaxpar.models.rope import rope_frequencies
from tests.helpers import SMALL_MODEL

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 258, (2, 24)), jnp.int32)


def _model(**overrides):
  return build_model(ModelConfig(**{**SMALL_MODEL, **overrides}), nnx.Rngs(0))


def _logits(model, tokens=TOKENS, positions=None, segment_ids=None):
  return nnx.jit(lambda m, t, p, s: m(t, p, s)[0])(model, tokens, positions, segment_ids)


@pytest.fixture(scope="module")
def scanned():
  return _model()


def test_scan_and_unrolled_layers_agree(scanned):
  unrolled = _model(scan_layers=False)
  stacked = nnx.to_pure_dict(nnx.state(scanned))
  params = nnx.to_pure_dict(nnx.state(unrolled))
  for i in range(SMALL_MODEL["num_layers"]):
    params["layers"][i] = jax.tree.map(lambda x: x[i], stacked["layers"])
  for key in ("embed", "final_norm", "unembed"):
    params[key] = stacked[key]
  nnx.update(unrolled, params)
  np.testing.assert_allclose(_logits(unrolled), _logits(scanned), rtol=1e-5, atol=1e-5)


MIXED_REMAT = {"decoder_layer_input": "offload", "qkv_proj": "save", "mlp_in": "offload",
               "attention_out": "recompute"}


@pytest.mark.parametrize("remat", ["full", "save_dots", "save_dots_no_batch", MIXED_REMAT])
def test_remat_policies_keep_gradients(scanned, remat):
  def grads(model):
    return nnx.jit(nnx.grad(lambda m: jnp.mean(m(TOKENS)[0] ** 2)))(model)
  rematted = _model(remat=remat)
  for a, b in zip(jax.tree.leaves(grads(rematted)), jax.tree.leaves(grads(scanned))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_every_configurable_remat_name_is_tagged_in_the_layers(scanned):
  jaxpr = jax.make_jaxpr(lambda m: m(TOKENS)[0])(scanned)
  tagged = set()

  def visit(jaxpr):
    tagged.update(e.params["name"] for e in jaxpr.eqns if e.primitive.name == "name")
    for sub in jax.extend.core.subjaxprs(jaxpr):
      visit(sub)
  visit(jaxpr.jaxpr)
  assert tagged == set(REMAT_NAMES)


def test_causal_future_tokens_do_not_change_the_past(scanned):
  changed = TOKENS.at[:, 12:].set((TOKENS[:, 12:] + 7) % 258)
  before, after = _logits(scanned), _logits(scanned, changed)
  np.testing.assert_allclose(before[:, :12], after[:, :12], rtol=1e-5, atol=1e-5)
  assert not np.allclose(before[:, 12:], after[:, 12:])


def test_packed_segments_do_not_see_each_other(scanned):
  # Row = [doc A (10 tokens) | doc B (14 tokens)] must give doc B the logits it has alone.
  segment_ids = jnp.asarray([[1] * 10 + [2] * 14] * 2, jnp.int32)
  positions = jnp.asarray([list(range(10)) + list(range(14))] * 2, jnp.int32)
  packed = _logits(scanned, TOKENS, positions, segment_ids)
  alone = _logits(scanned, TOKENS[:, 10:])
  np.testing.assert_allclose(packed[:, 10:], alone, rtol=1e-5, atol=1e-5)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
  plain = rope_frequencies(128, 500000.0)
  scaled = rope_frequencies(128, 500000.0, RopeScaling())
  wavelength = 2 * np.pi / np.asarray(plain)
  high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
  np.testing.assert_allclose(scaled[high], plain[high])
  np.testing.assert_allclose(scaled[low], plain[low] / 8.0)
  mid = ~high & ~low
  assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8.0)


def test_gqa_qk_norm_bias_and_tied_variants_run():
  model = _model(num_kv_heads=1, qk_norm=True, attention_bias=True, tie_embeddings=True)
  state = nnx.to_pure_dict(nnx.state(model))
  assert state["layers"]["attn"]["k"].shape == (2, 64, 1, 16)
  assert "q_norm" in state["layers"]["attn"] and "q_bias" in state["layers"]["attn"]
  assert "unembed" not in state
  logits = _logits(model)
  assert logits.shape == (2, 24, 512) and bool(jnp.all(jnp.isfinite(logits)))


def test_bf16_compute_tracks_f32(scanned):
  bf16 = _model(compute_dtype="bfloat16")
  out16, out32 = _logits(bf16), _logits(scanned)
  assert out16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out16, np.float32), out32, atol=0.1)
