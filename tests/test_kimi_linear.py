"""Kimi Linear, from a random-weight `transformers` model at small, odd shapes: 3 latent-
attention heads (no positions; q without a latent), 3 Kimi Delta Attention heads, five layers
whose last is linear, the first dense, then sigmoid-routed experts in two groups of which a
token takes one, with a shared expert and a correction bias. Import gives transformers'
logits, export writes its tensors back bit for bit (the dense layer's MLP under Moonshot's
name), and generation through the engine's latent pages and recurrent states equals
transformers.generate."""

import numpy as np
import pytest

from jaxpar.errors import ConfigError
from tests.test_hf import assert_generates_like_transformers, assert_round_trip_near_float64

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention", "linear_attention"]


def _hf_config(**overrides):
  return transformers.KimiLinearConfig(**{
      "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "moe_intermediate_size": 24,
      "num_hidden_layers": 5, "num_attention_heads": 3, "num_key_value_heads": 3, "kv_lora_rank": 16,
      "qk_nope_head_dim": 8, "qk_rope_head_dim": 6, "v_head_dim": 12, "num_local_experts": 4,
      "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
      "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "layer_types": TYPES,
      "linear_attn_config": {"head_dim": 16, "num_heads": 3, "short_conv_kernel_size": 4},
      "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **overrides})


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  from jaxpar.convert.hf import hf_to_jaxpar
  directory = tmp_path_factory.mktemp("kimi_linear")
  torch.manual_seed(0)
  # Eager experts: the grouped-matmul form takes no float64 (the exact logits below).
  model = transformers.AutoModelForCausalLM.from_config(_hf_config(), experts_implementation="eager").eval()
  with torch.no_grad():  # every weight random (norms near 1: they multiply by their scale)
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):
        b.copy_(0.1 * torch.randn_like(b))
  model.save_pretrained(directory / "hf")
  return model, hf_to_jaxpar(directory / "hf", directory / "jaxpar"), directory


def test_imports_with_logits_parity_and_exports_exactly(imported):
  model, config, directory = imported
  m = config.model
  assert [k.mixer for k in m.layer_pattern] == ["gated_deltanet", None]  # cycled: layer 4 is linear
  assert not m.layer_pattern[1].rope
  assert (m.family, m.first_dense_layers, m.moe.num_groups, m.moe.shared_mlp_dim, m.gated_deltanet.variant) == \
      ("kimi_linear", 1, 2, 24, "kimi")
  # transformers saves the dense layer's MLP as block_sparse_moe.*; the export writes Moonshot's mlp.*
  assert_round_trip_near_float64(model, config, directory, TYPES,
                                 renamed=(("layers.0.block_sparse_moe.", "layers.0.mlp."),))


def test_reads_the_layer_kinds_of_moonshots_config():
  """Moonshot's config.json has no layer_types: linear_attn_config counts layers from 1."""
  from jaxpar.models.families.kimi_linear.hf import config_from_hf
  hf = _hf_config().to_dict()
  hf.pop("layer_types")
  hf["linear_attn_config"].update(full_attn_layers=[2, 5], kda_layers=[1, 3, 4])
  pattern = config_from_hf(hf).layer_pattern  # cycled: linear, full, linear | linear, full
  assert [k.mixer for k in pattern] == ["gated_deltanet", None, "gated_deltanet"]
  with pytest.raises(ConfigError, match="dense layers only before the first MoE layer"):
    config_from_hf({**hf, "mlp_layer_types": ["dense", "sparse", "dense", "sparse", "sparse"]})


def test_generates_like_transformers(imported):
  """Greedy through the engine: a 10-token prompt in prefill chunks of 8 (the latent pages and
  the delta-rule state carry from one chunk to the next), then 48 decode steps."""
  model, config, directory = imported
  engine = assert_generates_like_transformers(model, directory, max_tokens=48)
  assert engine.cache_bytes["states"] > 0 and engine.cache_bytes["pool"] > 0


def test_export_refuses_what_kimi_linear_cannot_say(imported):
  from jaxpar.convert.hf import hf_config_from_model
  m = imported[1].model
  with_rope = type(m)(**{**m.model_dump(), "layer_pattern": [{"mixer": "gated_deltanet"}, {}]})
  with pytest.raises(ConfigError, match="give it rope: false"):
    hf_config_from_model(with_rope, "float32")
  with pytest.raises(ConfigError, match="model.gated_deltanet.variant='qwen' has no Hugging Face kimi_linear"):
    hf_config_from_model(type(m)(**{**m.model_dump(), "gated_deltanet": {**m.gated_deltanet.model_dump(),
                                                                         "variant": "qwen"}}), "float32")


def test_shipped_config_has_transformers_parameter_count():
  """Our parameter count at real size equals transformers' for the config we would export
  (built on the meta device: no memory), and the export names Moonshot's layer kinds."""
  from jaxpar.config import load_config
  from jaxpar.convert.hf import hf_config_from_model
  from jaxpar.runtime import abstract_model, count_params
  model = load_config("kimi-linear-48b-a3b").model
  hf_config = hf_config_from_model(model, "bfloat16")
  assert hf_config["linear_attn_config"]["full_attn_layers"] == [4, 8, 12, 16, 20, 24, 27]
  with torch.device("meta"):
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
  assert count_params(abstract_model(model)[1]) == sum(p.numel() for p in hf_model.parameters())


def test_train_step_on_8_devices_equals_one_device():
  """The tiny hybrid (a dense linear first layer, then linear and latent-attention layers over
  routed experts) on fsdp x tensor x expert: Kimi Delta Attention's heads split over `tensor`,
  the experts over `expert`; every parameter's gradient equals one device's."""
  import jax
  from jaxpar.config import MeshConfig, load_config
  from jaxpar.objectives.lm import lm_loss
  from jaxpar.runtime import Runtime
  from jaxpar.train.step import make_gradients
  from tests.helpers import small_config, synthetic_batch
  model = load_config("tiny-kimi-linear").model
  model = type(model)(**{**model.model_dump(), "embed_dim": 64, "mlp_dim": 96, "max_seq_len": 32})
  batch = synthetic_batch(small_config(data={"global_batch_size": 8}))
  wide = Runtime(model, MeshConfig(fsdp=2, tensor=2, expert=2))
  one = Runtime(model, MeshConfig(fsdp=1), jax.devices()[:1])
  params, model_state = wide.init()

  def gradients(runtime):
    step = jax.jit(make_gradients(lm_loss(runtime.graphdef, z_loss=1e-4, logits_chunk_len=0), microbatches=1))
    with runtime.context():
      put = lambda tree, shardings: jax.device_put(jax.device_get(tree), shardings)  # noqa: E731
      return jax.device_get(step(put(params, runtime.param_shardings), batch,
                                 put(model_state, runtime.model_state_shardings))[:2])

  (want, want_sums), (got, got_sums) = gradients(one), gradients(wide)
  np.testing.assert_allclose(got_sums["ce_sum"], want_sums["ce_sum"], rtol=1e-5)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    name = jax.tree_util.keystr(path)
    assert np.abs(w).max() > 0, name
    # A log decay rate's gradient sums every position's chain of decays: on an Intel Xeon host
    # one entry of the dense first layer's landed 1.2e-4 of its largest apart (5e-5 held on the
    # hosts before); every other gradient stays within 5e-5 of its largest entry.
    spread = 2.5e-4 if name.endswith("['a_log']") else 5e-5
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=spread * np.abs(w).max(), err_msg=name)


def test_batched_preempted_and_speculative_requests_get_their_own_tokens():
  """The tiny hybrid through the engine: latent pages for the attention layers, a state per slot
  for the linear ones. Six requests over 4 reused slots with a pool small enough to preempt get
  the tokens each gets alone; greedy n-gram speculation (drafts kept and rejected, the states
  rolled back) gives plain decoding's tokens."""
  import jax
  from jaxpar.config import MeshConfig, load_config
  from jaxpar.data import ByteTokenizer
  from jaxpar.inference import Engine, SamplingParams
  from jaxpar.inference.speculative import NgramDraft
  from jaxpar.runtime import Runtime
  model = load_config("tiny-kimi-linear", ["model.max_seq_len=64", "data.seq_len=32"]).model
  runtime = Runtime(model, MeshConfig(fsdp=1), jax.devices()[:1], seed=0)
  params, model_state = runtime.init()

  def engine(**options):
    return Engine(runtime, params, ByteTokenizer(), model_state=model_state, page_size=4, prefill_chunks=(8,),
                  **options)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 14, 5, 11, 7)]
  settings = [SamplingParams(max_tokens=12, temperature=t, seed=i, stop_token_ids=())
              for i, t in enumerate((0.0, 0.8, 0.0, 0.8, 0.0, 0.8))]
  pooled = engine(slots=4, num_pages=16)
  together = pooled.generate(prompts, settings)
  assert pooled.stats["preemptions"] > 0
  assert [r.tokens for r in together] == [pooled.generate([p], s)[0].tokens for p, s in zip(prompts, settings)]

  repeating = [[5, 6, 7, 8] * 4, [9, 1] * 6]
  greedy = SamplingParams(max_tokens=20, stop_token_ids=())
  want = [r.tokens for r in pooled.generate(repeating, greedy)]  # a row's tokens are its own (above)
  drafted = engine(slots=2, speculative=NgramDraft(k=3))
  assert [r.tokens for r in drafted.generate(repeating, greedy)] == want
  assert drafted.stats["speculative_proposed"] > 0
