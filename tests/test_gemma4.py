"""Gemma 4 (text) from random-weight `transformers` models at small, unusual shapes: local
layers of 16-wide heads beside global ones of 32 with their own KV heads and values equal
to keys, learned layer scalars,
proportional RoPE, the final soft cap and an untied head; and a variant with experts
beside each MLP. Import with f32 logits as near
transformers' float64 ones as its own, export back exactly, greedy generation through the
paged cache equal to transformers.generate past the window and across a preemption; a
train step on 8 devices equal to one device's; the published 31B's parameter count; and
what jaxpar does not build yet is a one-line error at import."""

import jax
import numpy as np
import pytest

from jaxpar.config import MeshConfig
from tests.helpers import gradients_on_8_devices_and_one

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW, PAGE = 8, 4
TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SHAPES = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=320,
              layer_types=TYPES, sliding_window=WINDOW, final_logit_softcapping=3.0, tie_word_embeddings=False,
              max_position_embeddings=96, eos_token_id=None, pad_token_id=None)  # any token may come: none stops or pads


def _random_gemma4(directory, **overrides):
  """Every weight random, norms and the layer scalars (a buffer HF saves) near 1."""
  torch.manual_seed(0)
  # The eager experts: the grouped ones take no float64, which the parity check compares with.
  model = transformers.AutoModelForCausalLM.from_config(transformers.Gemma4TextConfig(**{**SHAPES, **overrides}),
                                                        experts_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("layer_scalar"):
        b.copy_(1 + 0.1 * torch.randn_like(b))
  model.eval().save_pretrained(directory)
  return model


# The dense model with per-layer inputs; the same with its last two layers (one local, one
# global) reusing the keys and values of the last earlier layer of their type, with MLPs of
# twice the width (E2B/E4B's); and one with experts beside each MLP (26B-A4B's) whose
# global layers keep their own values and the local KV head count.
VARIANTS = {"dense": {}, "shared": dict(num_kv_shared_layers=2, use_double_wide_mlp=True),
            "moe": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24,
                        hidden_size_per_layer_input=0, attention_k_eq_v=False, num_global_key_value_heads=None)}
MIXERS = {"dense": [None, None, "gemma4_global", None, "gemma4_global"],
          "shared": [None, None, "gemma4_global", "gemma4_shared", "gemma4_global_shared"]}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma4(request, tmp_path_factory):
  from jaxpar.convert.hf import hf_to_jaxpar
  directory = tmp_path_factory.mktemp(f"gemma4_{request.param}")
  model = _random_gemma4(directory / "hf", **VARIANTS[request.param])
  return model, hf_to_jaxpar(directory / "hf", directory / "jaxpar"), directory


def test_imports_near_float64_and_exports_exactly(gemma4):
  from tests.test_hf import assert_round_trip_near_float64
  model, config, directory = gemma4
  m = config.model
  moe = model.config.enable_moe_block
  assert (m.family, m.global_head_dim, m.global_kv_heads, m.keys_as_values, m.per_layer_input_dim) == (
      ("gemma4", 32, None, False, 0) if moe else ("gemma4", 32, 1, True, 8))
  assert (m.moe.num_experts, m.moe.experts_per_token, m.moe.expert_mlp_dim) == (4, 2, 24) if moe else m.moe is None
  shared = model.config.num_kv_shared_layers
  assert [k.mixer for k in m.layer_pattern] == MIXERS["shared" if shared else "dense"]
  assert m.double_wide_mlp == bool(shared)
  assert_round_trip_near_float64(model, config, directory, TYPES)


def test_generates_like_transformers_past_the_window(gemma4):
  from tests.test_hf import assert_generates_like_transformers
  model, _, directory = gemma4
  engine = assert_generates_like_transformers(model, directory, max_tokens=48, page_size=PAGE)
  # Both groups keep only their window's rings or the pool: the local layers hold no pool pages,
  # and the layers that reuse others' keys hold nothing.
  assert set(engine.cache["layers"]) == {"windowed"} and "k" in engine.cache["gemma4_global_layers"]
  assert all(engine.cache[g] == {} for g in ("gemma4_shared_layers", "gemma4_global_shared_layers") if g in engine.cache)


def test_two_requests_across_a_preemption_get_transformers_tokens(gemma4):
  """Two rows over a pool of 24 pages where each needs 15 (the global layers'; the local
  layers' rings are apart): one is preempted and recomputed, and each still gets what
  transformers.generate gives it alone."""
  from jaxpar.data import ByteTokenizer
  from jaxpar.inference import Engine, SamplingParams
  model, _, directory = gemma4
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, 320, n).tolist() for n in (10, 7)]
  with torch.no_grad():
    want = [model.generate(torch.tensor([p]), max_new_tokens=48, min_new_tokens=48, do_sample=False)[0, len(p):].tolist()
            for p in prompts]
  engine = Engine.from_checkpoint(directory / "jaxpar", mesh={"data": 1, "fsdp": 1}, devices=jax.devices()[:1],
                                  tokenizer=ByteTokenizer(), slots=2, page_size=PAGE, num_pages=24,
                                  prefill_chunks=(8,), max_seq_len=64)
  got = engine.generate(prompts, SamplingParams(max_tokens=48, stop_token_ids=()))
  assert engine.stats["preemptions"] > 0
  assert [r.tokens for r in got] == want


def test_train_step_on_8_devices_equals_one_device():
  """The tiny config (per-layer inputs, wide global heads whose values are their keys) with
  experts beside each MLP and its last two layers reusing earlier ones' keys and values
  (with double-wide MLPs), on fsdp=2 x expert=2 x tensor=2 with the fused loss through the
  final soft cap, against one device."""
  from jaxpar.config import load_config, replace
  config = load_config("tiny-gemma4", ["model.final_logit_soft_cap=3.0", "model.max_seq_len=32", "data.seq_len=32",
                                       "model.tie_embeddings=false"])
  local = {"sliding_window": 32, "rope_theta": 10000.0, "rope_scaling": None}
  model = replace(config, model={
      "moe": {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 64, "activation": "gelu_tanh",
              "balance_loss": 0.0, "router_z_loss": 0.0},
      "layer_pattern": [local] * 3 + [{"mixer": "gemma4_global"}, {**local, "mixer": "gemma4_shared"},
                                      {"mixer": "gemma4_global_shared"}],
      "double_wide_mlp": True}).model
  (want, want_sums), (got, got_sums) = gradients_on_8_devices_and_one(model, MeshConfig(fsdp=2, expert=2, tensor=2))
  assert np.abs(want["layers"]["experts"]["expert_scale"]).min() > 0
  assert want["gemma4_shared_layers"]["mlp"]["up"].shape[-1] == 2 * model.mlp_dim
  np.testing.assert_allclose(got_sums["ce_sum"], want_sums["ce_sum"], rtol=1e-5)
  assert np.abs(want["per_layer_inputs"]["table"]).max() > 0 and np.abs(want["layers"]["layer_scalar"]).min() > 1
  # The last layer's scalar only scales what the final RMSNorm divides back out: its gradient
  # is 0 up to rounding (1.7e-5 against the others' 4 to 29), on both meshes.
  last = [np.abs(g["gemma4_global_shared_layers"]["layer_scalar"]).max() for g in (want, got)]
  assert max(last) < 1e-4 * np.abs(want["layers"]["layer_scalar"]).max()
  # Unscaled scores (q and k normed to ~unit entries, then dotted whole) make the softmax
  # sharp: the two meshes' sums in other orders land up to 5.4e-5 of each leaf's largest
  # entry apart (2.6e-6 with the scores scaled by 64 ** -0.5).
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    if "layer_scalar" in jax.tree_util.keystr(path) and "global_shared" in jax.tree_util.keystr(path):
      continue
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))


def test_the_31b_config_has_the_published_models_parameters():
  """Our parameter count at real size equals transformers' for the config we export (on the
  meta device: no memory), and the model card's 30.7B."""
  from jaxpar.config import load_config
  from jaxpar.convert.hf import hf_config_from_model
  from jaxpar.runtime import abstract_model, count_params
  model = load_config("gemma4-31b").model
  with torch.device("meta"):
    hf_model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**hf_config_from_model(model, "bfloat16")))
  ours = count_params(abstract_model(model)[1])
  assert ours == sum(p.numel() for p in hf_model.parameters()) + sum(
      b.numel() for n, b in hf_model.named_buffers() if n.endswith("layer_scalar"))
  assert round(ours / 1e9, 1) == 30.7


@pytest.mark.parametrize("key, value, what", [("use_bidirectional_attention", "all", "bidirectional")])
def test_what_jaxpar_does_not_build_yet_is_a_one_line_error(tmp_path, key, value, what):
  from jaxpar.errors import ConfigError
  from jaxpar.models.families.gemma.hf_gemma4 import config_from_hf
  hf = transformers.Gemma4TextConfig(**{**SHAPES, key: value}).to_dict()
  with pytest.raises(ConfigError, match=f"{key}={value!r} is not supported yet: .*{what}"):
    config_from_hf(hf)


def test_imports_the_text_model_of_a_multimodal_checkpoint(tmp_path):
  """The published checkpoints are Gemma4ForConditionalGeneration: its text model's tensors
  (under model.language_model.) import, the vision tower's are left out, and text-only
  logits are as near its float64 ones as its own f32 logits."""
  from jaxpar.convert.hf import hf_to_jaxpar
  from tests.test_hf import _our_logits
  text = transformers.Gemma4TextConfig(**{**SHAPES, "tie_word_embeddings": True, "pad_token_id": 0})
  vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=16)
  torch.manual_seed(0)
  model = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
      text_config=text.to_dict(), vision_config=vision, audio_config=None)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  model.save_pretrained(tmp_path / "hf")
  config = hf_to_jaxpar(tmp_path / "hf", tmp_path / "jaxpar")
  assert (config.model.family, config.model.per_layer_input_dim, config.model.tie_embeddings) == ("gemma4", 8, True)
  tokens = np.random.default_rng(0).integers(0, 320, (2, 24))
  with torch.no_grad():
    theirs = model(torch.tensor(tokens)).logits.numpy()
    exact = model.double()(torch.tensor(tokens)).logits.numpy()
  ours = _our_logits(tmp_path / "jaxpar", config, tokens)
  assert np.abs(ours - exact).max() <= max(3 * np.abs(theirs - exact).max(), 1e-5 * np.abs(exact).max())


def test_kv_sharing_over_a_quantized_cache_is_a_one_line_error():
  """The sharing layers read their source's float keys: a quantized cache is refused before anything runs."""
  import jax.numpy as jnp
  from flax import nnx
  from jaxpar.config import load_config, replace
  from jaxpar.errors import ConfigError
  from jaxpar.models.kv_quant import KVQuantization
  from jaxpar.runtime import Runtime
  config = load_config("tiny-gemma4", ["model.num_layers=3", "model.per_layer_input_dim=0"])
  model = replace(config, model={"layer_pattern": [{"sliding_window": 32}, {"mixer": "gemma4_global"},
                                                   {"mixer": "gemma4_global_shared"}]}).model
  runtime = Runtime(model, MeshConfig(fsdp=1), jax.devices()[:1])
  params, model_state = runtime.init()
  with runtime.context(), pytest.raises(ConfigError, match="KV sharing.*without KV quantization"):
    nnx.merge(runtime.graphdef, params, model_state)(jnp.zeros((1, 8), jnp.int32), kv_quantization=KVQuantization("int8"))
