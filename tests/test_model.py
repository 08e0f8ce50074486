"""The decoder model (llama family): layer stacking, remat, masking, RoPE, dtypes."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ConfigError, ModelConfig, RopeScaling, from_dict
from jaxpar.models.config import REMAT_NAMES
from jaxpar.models import Rope, build_model, kv_reach, layer_options
from jaxpar.models.flops import causal_attention_flops
from jaxpar.models.layer_pattern import unit_options
from jaxpar.models.rope import rope_frequencies
from tests.helpers import SMALL_MODEL, reference_decoder_logits

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


def test_gqa_qk_norm_bias_and_tied_variants_match_a_reference():
  model = _model(num_kv_heads=1, qk_norm=True, attention_bias=True, tie_embeddings=True)
  state = nnx.to_pure_dict(nnx.state(model))
  assert state["layers"]["attn"]["k"].shape == (2, 64, 1, 16)
  assert "q_norm" in state["layers"]["attn"] and "q_bias" in state["layers"]["attn"]
  assert "unembed" not in state
  # Random biases and norm scales (the init's are 0 and 1): every term shows.
  keys = iter(jax.random.split(jax.random.key(1), 100))
  for name in ("q_bias", "k_bias", "v_bias"):
    state["layers"]["attn"][name] = 0.3 * jax.random.normal(next(keys), state["layers"]["attn"][name].shape)
  for norm in ("q_norm", "k_norm"):
    state["layers"]["attn"][norm]["scale"] = 1 + 0.3 * jax.random.normal(next(keys), (2, 16))
  nnx.update(model, state)
  logits = np.asarray(_logits(model), np.float64)
  want = reference_decoder_logits(jax.tree.map(lambda x: np.asarray(x, np.float64), state), np.asarray(TOKENS))
  assert logits.shape == (2, 24, 512)
  np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_bf16_compute_tracks_f32(scanned):
  bf16 = _model(compute_dtype="bfloat16")
  out16, out32 = _logits(bf16), _logits(scanned)
  assert out16.dtype == jnp.bfloat16
  # bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per op); measured 1.1e-2 here.
  out16, out32 = np.asarray(out16, np.float64), np.asarray(out32, np.float64)
  assert np.linalg.norm(out16 - out32) / np.linalg.norm(out32) < 2e-2


# Gemma 3's layout: five local layers (window, their own rope base, no scaling), one global.
GEMMA3_STYLE = dict(num_layers=8, rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                    layer_pattern=[{"sliding_window": 6, "rope_theta": 1e4, "rope_scaling": None}] * 5 + [{}])


def _copy_params(scanned, unrolled):
  stacked, params = nnx.to_pure_dict(nnx.state(scanned)), nnx.to_pure_dict(nnx.state(unrolled))
  for i in range(len(params["layers"])):
    params["layers"][i] = jax.tree.map(lambda x: x[i], stacked["layers"])
  for key in ("embed", "final_norm", "unembed"):
    params[key] = stacked[key]
  nnx.update(unrolled, params)


def test_layer_pattern_resolves_per_layer_and_saves_as_given():
  cfg = ModelConfig(**{**SMALL_MODEL, **GEMMA3_STYLE})
  local, full = layer_options(cfg, 0), layer_options(cfg, 5)
  assert local.attention.sliding_window == 6 and local.rope == Rope(1e4, None)
  assert full.attention.sliding_window is None and full.rope == Rope(1e6, cfg.rope_scaling)
  assert layer_options(cfg, 10) == local and layer_options(cfg, 11) == full
  assert unit_options(cfg, 0, 12) == [local] * 5 + [full] and unit_options(cfg, 2, 10)[3] == full
  # A run that ends inside a unit keeps the unit (the scan's tail runs its start); one layer is its own.
  assert unit_options(cfg, 0, 8) == [local] * 5 + [full] and unit_options(cfg, 0, 1) == [local]
  assert kv_reach(cfg) is None and kv_reach(ModelConfig(**SMALL_MODEL, sliding_window=9)) == 9
  dumped = cfg.model_dump(mode="json")  # keys left out stay left out: `{}` is the model's layer
  assert dumped["layer_pattern"][0] == {"sliding_window": 6, "rope_theta": 1e4, "rope_scaling": None}
  assert dumped["layer_pattern"][5] == {} and ModelConfig.model_validate(dumped) == cfg
  # MFU counts the keys each layer sees: with a window of half a 12-token sequence, 3/4 of
  # the causal keys, on 7 of the 8 layers.
  full = causal_attention_flops(cfg.model_copy(update={"layer_pattern": ()}), 12)
  assert causal_attention_flops(cfg, 12) == full * (7 * 0.75 + 1) / 8
  with pytest.raises(ConfigError, match="model.layer_pattern.0.sliding_window=0"):
    from_dict({"model": {"layer_pattern": [{"sliding_window": 0}]}})
  with pytest.raises(ConfigError, match="unknown config key 'model.layer_pattern.0.window'"):
    from_dict({"model": {"layer_pattern": [{"window": 8}]}})


def test_pattern_options_reach_every_layer_scanned_or_not(scanned):
  base = _logits(scanned)
  by_pattern = _logits(_model(layer_pattern=[{"rope_theta": 1e6}]))
  np.testing.assert_array_equal(by_pattern, _logits(_model(rope_theta=1e6)))
  assert not np.allclose(by_pattern, base, atol=1e-3)
  # 4 layers of a 3-layer pattern: one scanned unit, then a tail of 1.
  mixed = dict(num_layers=4, rope_scaling={"rope_type": "linear", "factor": 4.0},
               layer_pattern=[{"sliding_window": 5, "rope_scaling": None}, {"rope": False}, {}])
  stacked, unrolled = _model(**mixed), _model(scan_layers=False, **mixed)
  _copy_params(stacked, unrolled)
  np.testing.assert_allclose(_logits(stacked), _logits(unrolled), rtol=1e-5, atol=1e-5)


def test_window_bounds_what_a_full_forward_sees():
  """Two layers with a window of 4: position t sees tokens back to t - 6 and no further."""
  model = _model(sliding_window=4)
  changed = TOKENS.at[:, :2].set((TOKENS[:, :2] + 7) % 258)
  before, after = _logits(model), _logits(model, changed)
  np.testing.assert_allclose(before[:, 8:], after[:, 8:], rtol=1e-5, atol=1e-5)
  assert not np.allclose(before[:, 7], after[:, 7], atol=1e-3)


def test_compile_size_is_flat_in_depth():
  """A mixed stack scans units of one period: 12 or 24 layers trace the same program, and
  a tail of 2 layers adds the same amount at any depth."""
  def size(layers):
    cfg = ModelConfig(**{**SMALL_MODEL, **GEMMA3_STYLE, "num_layers": layers})
    model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
    return len(jax.make_jaxpr(lambda m: m(TOKENS)[0])(model).jaxpr.eqns)
  assert size(12) == size(24) < size(14) == size(26)
