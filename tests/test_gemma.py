"""Gemma 2 and Gemma 3 (text) from random-weight `transformers` models at small, unusual
shapes (4 query heads per kv head, untied output head, a window of 8 under 40+ tokens,
query_pre_attn_scalar != head_dim, Gemma 3 with a 2:1 local:global period): import with
f32 logits parity, export back exactly, greedy generation through the engine's paged cache
equal to transformers.generate past the window; and a train step on 8 devices (fsdp x
tensor, the fused loss through the final soft-cap) equal to one device's (plain logits)."""

import jax
import numpy as np
import pytest

from jaxpar.config import MeshConfig
from tests.helpers import gradients_on_8_devices_and_one

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW, PAGE = 8, 4
SHAPES = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
              head_dim=16, max_position_embeddings=96, sliding_window=WINDOW, query_pre_attn_scalar=24,
              tie_word_embeddings=False, eos_token_id=None)  # greedy may pick any token: nothing stops or is banned
HF_CONFIGS = {
    "gemma2": lambda: transformers.Gemma2Config(**SHAPES, num_hidden_layers=2, attn_logit_softcapping=4.0,
                                                final_logit_softcapping=3.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPES, num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def family(request, tmp_path_factory):
  from jaxpar.convert.hf import hf_to_jaxpar
  from tests.test_hf import _random_hf_model
  directory = tmp_path_factory.mktemp(request.param)
  model = _random_hf_model(HF_CONFIGS[request.param](), directory / "hf")
  config = hf_to_jaxpar(directory / "hf", directory / "jaxpar")
  return request.param, model, config, directory


def test_imports_with_logits_parity_and_exports_exactly(family):
  from tests.test_hf import assert_round_trip
  name, model, config, directory = family
  m = config.model
  assert (m.family, m.num_kv_heads, m.tie_embeddings, m.query_pre_attn_scalar) == (name, 1, False, 24)
  assert [k.sliding_window for k in m.layer_pattern] == ([WINDOW, None] if name == "gemma2" else [WINDOW, WINDOW, None])
  reloaded = assert_round_trip(model, config, directory)
  assert reloaded.config.layer_types == model.config.layer_types


def test_generates_like_transformers_past_the_window(family):
  from tests.test_hf import assert_generates_like_transformers
  _, model, _, directory = family
  engine = assert_generates_like_transformers(model, directory, max_tokens=40, page_size=PAGE)  # 32 past the window of 8
  # The local layers keep rings of their window's pages (models/kv_cache_windowed.py).
  assert set(engine.cache["layers"]) == {"full", "windowed"} and engine.cache_bytes["rings"] > 0


def test_train_step_on_8_devices_equals_one_device():
  """One model with every Gemma piece (Gemma 2's soft caps and alternation, Gemma 3's
  QK-norm and local RoPE) and GPT-OSS's sinks: one compile pair instead of three."""
  from jaxpar.models.families.gemma.config import Gemma2Config
  model = Gemma2Config(vocab_size=320, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16,
                       mlp_dim=96, max_seq_len=32, tie_embeddings=False, qk_norm=True, attention_sinks=True,
                       query_pre_attn_scalar=24, attn_logit_soft_cap=4.0, final_logit_soft_cap=3.0,
                       layer_pattern=[{"sliding_window": WINDOW, "rope_theta": 100.0}, {}])
  (want, want_sums), (got, got_sums) = gradients_on_8_devices_and_one(model, MeshConfig(fsdp=4, tensor=2))
  np.testing.assert_allclose(got_sums["ce_sum"], want_sums["ce_sum"], rtol=1e-5)
  assert np.abs(want["layers"]["attn"]["sinks"]).min() > 0, "every sink gets a gradient"
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", ["gemma2-9b", "gemma3-12b"])
def test_shipped_configs_have_the_real_models_parameters(name):
  """Our parameter count at real size equals transformers' for the config we would export
  (built on the meta device: no memory), so the shipped shapes are the real model's."""
  from jaxpar.config import load_config
  from jaxpar.convert.hf import hf_config_from_model
  from jaxpar.runtime import abstract_model, count_params
  model = load_config(name).model
  hf_config = hf_config_from_model(model, "bfloat16")
  with torch.device("meta"):
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf_config))
  assert count_params(abstract_model(model)[1]) == sum(p.numel() for p in hf_model.parameters())
