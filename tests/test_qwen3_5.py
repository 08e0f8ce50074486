"""Qwen3.5 (text), the Gated DeltaNet hybrid, from a random-weight `transformers` model at
small, odd shapes: 3 query heads on 1 kv head, 4 value heads on 2 key heads, key_dim 16 !=
value_dim 12, a quarter of head_dim rotary, five layers whose pattern ends on a linear layer.
Import gives transformers' logits, export writes its tensors back bit for bit; a hybrid train
step over packed documents on fsdp x tensor equals one device's; the FLOPs count the
projections the model really has; generation through the engine's per-slot recurrent state
equals transformers.generate, and batching, slot reuse and preemption change no token."""

import jax
import numpy as np
import pytest

from jaxpar.config import MeshConfig
from jaxpar.errors import ConfigError
from jaxpar.models.families.qwen3_5.config import Qwen35Config
from jaxpar.objectives.lm import lm_loss
from jaxpar.runtime import Runtime
from jaxpar.train.step import make_gradients
from tests.helpers import small_config, synthetic_batch
from tests.test_hf import assert_round_trip_near_float64

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TYPES = ["linear_attention"] * 3 + ["full_attention", "linear_attention"]


LINEAR_SHAPES = dict(vocab_size=64, hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=12,
                     max_position_embeddings=128, num_hidden_layers=5, layer_types=TYPES)
MOE_SHAPES = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20)
HF_CONFIGS = {
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**LINEAR_SHAPES, intermediate_size=80),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**LINEAR_SHAPES, **MOE_SHAPES),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**LINEAR_SHAPES, **MOE_SHAPES, intermediate_size=80),
}


def _import(family, directory):
  from jaxpar.convert.hf import hf_to_jaxpar
  torch.manual_seed(0)
  # Eager experts: the grouped-matmul form takes no float64 (the exact logits below).
  model = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[family](), experts_implementation="eager").eval()
  with torch.no_grad():  # every weight random; these norms store (scale - 1), the gated norm the scale
    for name, p in model.named_parameters():
      p.copy_(0.1 * torch.randn_like(p) + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
  model.save_pretrained(directory / "hf")
  return model, hf_to_jaxpar(directory / "hf", directory / "jaxpar"), directory


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  return _import("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def imported_moe(request, tmp_path_factory):
  return _import(request.param, tmp_path_factory.mktemp(request.param))


def test_imports_with_logits_parity_and_exports_exactly(imported):
  model, config, directory = imported
  m = config.model
  assert [k.mixer for k in m.layer_pattern] == ["gated_deltanet"] * 3 + [None]  # cycled: layer 4 is linear
  assert (m.family, m.rope_fraction, m.gated_deltanet.num_value_heads, m.gated_deltanet.key_head_dim) == \
      ("qwen3_5", 0.25, 4, 16)
  assert_round_trip_near_float64(model, config, directory, TYPES)


def test_moe_variants_import_with_logits_parity_and_export_exactly(imported_moe):
  """Qwen3.5 MoE and Qwen3-Next: routed experts, a sigmoid-gated shared expert, and (Qwen3-Next)
  q, k, v, z and b, a grouped by key head in one tensor each."""
  model, config, directory = imported_moe
  m = config.model
  assert (m.mlp, m.moe.num_experts, m.moe.shared_mlp_dim, m.moe.shared_gate) == ("moe", 4, 20, True)
  assert_round_trip_near_float64(model, config, directory, TYPES)


def test_generates_like_transformers(imported):
  """Greedy through the engine (a 10-token prompt in prefill chunks of 8, so the state
  carries from one chunk to the next, then 48 decode steps) equals transformers.generate."""
  from tests.test_hf import assert_generates_like_transformers
  model, config, directory = imported
  engine = assert_generates_like_transformers(model, directory, max_tokens=48)
  g, slots, linear = config.model.gated_deltanet, 1, TYPES.count("linear_attention")
  per_slot = 4 * g.num_value_heads * g.key_head_dim * g.value_head_dim + 4 * (g.conv_kernel - 1) * (
      2 * g.num_key_heads * g.key_head_dim + g.num_value_heads * g.value_head_dim)  # f32 state and conv inputs
  assert engine.cache_bytes["states"] == linear * slots * per_slot
  assert not engine.sharing.enabled  # no state per prompt block to share


HYBRID = Qwen35Config(vocab_size=320, embed_dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                      mlp_dim=96, max_seq_len=32, gated_deltanet={"num_key_heads": 2, "num_value_heads": 4,
                                                                  "key_head_dim": 32, "value_head_dim": 8,
                                                                  "chunk_size": 8},
                      layer_pattern=[{"mixer": "gated_deltanet"}, {}])


def _gradients(runtime, params, batch):
  """(gradients, loss sums) of one train step on `runtime`'s mesh, on the host."""
  step = jax.jit(make_gradients(lm_loss(runtime.graphdef, z_loss=1e-4, logits_chunk_len=0), microbatches=1))
  with runtime.context():
    return jax.device_get(step(jax.device_put(jax.device_get(params), runtime.param_shardings), batch)[:2])


def test_train_step_on_8_devices_equals_one_device():
  """Packed documents (the state and the convolution restart at each), chunks that do not
  divide a document, value heads split over `tensor`, the sequence over `context` (zig-zag
  order, put back in order for the recurrence): the gradients of every parameter."""
  batch = synthetic_batch(small_config(data={"global_batch_size": 8}))
  wide = Runtime(HYBRID, MeshConfig(fsdp=2, context=2, tensor=2))
  one = Runtime(HYBRID, MeshConfig(fsdp=1), jax.devices()[:1])
  params, _ = wide.init()
  assert params["gated_deltanet_layers"]["attn"]["conv_v"].shape == (2, 4, 4, 8)  # [layers, taps, heads, dim]

  (want, want_sums), (got, got_sums) = (_gradients(runtime, params, batch) for runtime in (one, wide))
  np.testing.assert_allclose(got_sums["ce_sum"], want_sums["ce_sum"], rtol=1e-5)
  # The delta rule's gradients round more than attention's (measured here: up to 2.4e-5 of each
  # leaf's largest entry, 1.5e-4 with key_dim 16, the same on 8 x fsdp and with the reference
  # recurrence): a split that were wrong would be off by the entries themselves.
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    assert np.abs(w).max() > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=5e-5 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))


def test_the_pallas_kernel_trains_the_hybrid_as_the_xla_form_does():
  """`gated_deltanet.implementation: pallas` (the TPU kernel, interpret mode here) per device
  over fsdp=4 x tensor=2, against the XLA chunked form on one device: packed documents, every
  parameter's gradient."""
  batch = synthetic_batch(small_config(data={"global_batch_size": 8}))
  kernel = HYBRID.model_copy(update={"gated_deltanet": HYBRID.gated_deltanet.model_copy(
      update={"implementation": "pallas"})})
  wide = Runtime(kernel, MeshConfig(fsdp=4, tensor=2))
  one = Runtime(HYBRID.model_copy(update={"gated_deltanet": HYBRID.gated_deltanet.model_copy(
      update={"implementation": "chunked"})}), MeshConfig(fsdp=1), jax.devices()[:1])
  params, _ = one.init()

  (want, want_sums), (got, got_sums) = (_gradients(runtime, params, batch) for runtime in (one, wide))
  np.testing.assert_allclose(got_sums["ce_sum"], want_sums["ce_sum"], rtol=1e-5)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=5e-5 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))


def _hybrid_engine(**options):
  from jaxpar.data import ByteTokenizer
  from jaxpar.inference import Engine
  runtime = Runtime(HYBRID, MeshConfig(fsdp=1), jax.devices()[:1])
  params, model_state = runtime.init()
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, page_size=4, prefill_chunks=(8,),
                **options)


def test_batched_and_preempted_requests_get_their_own_tokens():
  """Four slots, reused by later requests (a slot's old state must not leak into the next
  sequence) and a page pool that forces preemption (the state is rebuilt from the prompt):
  every request's tokens equal its tokens alone, and greedy ones equal a full recompute."""
  from jaxpar.inference import SamplingParams
  engine = _hybrid_engine(slots=4, num_pages=16)
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 14, 5, 11, 7)]
  settings = [SamplingParams(max_tokens=12, temperature=t, seed=i, stop_token_ids=())
              for i, t in enumerate((0.0, 0.8, 0.0, 0.8, 0.0, 0.8))]
  together = engine.generate(prompts, settings)
  assert engine.stats["preemptions"] > 0
  alone = [engine.generate([p], s)[0].tokens for p, s in zip(prompts, settings)]
  assert [r.tokens for r in together] == alone
  logits_of = jax.jit(lambda params, tokens: engine.runtime.merge(params)(tokens)[0][0, -1])
  tokens = list(prompts[0])
  for _ in range(12):
    tokens.append(int(np.argmax(logits_of(engine.params, np.asarray([tokens], np.int32)))))
  assert alone[0] == tokens[len(prompts[0]):]


def test_constrained_requests_follow_their_regex_on_the_hybrid():
  """Structured output over the linear layers' states: the grammar masks the logits, and each of
  four sampled requests (sharing slots with a free one) is a full match of its pattern."""
  import re
  from jaxpar.inference import SamplingParams, grammar
  pytest.importorskip("llguidance")
  engine = _hybrid_engine(slots=4, num_pages=32)
  pattern = r"[0-9]{3}-[a-z]{4}"
  constraint = grammar.constraint("regex", pattern, "test", engine.tokenizer, engine.runtime.model_config.vocab_size)
  settings = [SamplingParams(max_tokens=16, temperature=1.0, seed=i, constraint=constraint) for i in range(4)]
  done = engine.generate([[7, 8, 9], [1] * 5, [2, 3], [4] * 9, [5, 6]],
                         settings + [SamplingParams(max_tokens=8, seed=9, stop_token_ids=())])
  for result in done[:4]:
    assert re.fullmatch(pattern, engine.tokenizer.decode(result.tokens)), result.tokens
  assert len(done[4].tokens) == 8


def test_flops_count_the_projections_the_model_has():
  from jaxpar.models.flops import mixer_params
  from jaxpar.runtime import abstract_model
  params = abstract_model(HYBRID)[1]
  mixers = {group: params[group]["attn"] for group in ("layers", "gated_deltanet_layers")}
  projections = sum(np.prod(a.shape) for mixer in mixers.values() for name, a in mixer.items()
                    if name in ("q", "k", "v", "o", "gate", "z", "a", "b"))
  assert mixer_params(HYBRID) == projections


def test_a_linear_mixer_needs_its_shape():
  with pytest.raises(ValueError, match="model.gated_deltanet"):
    Qwen35Config(gated_deltanet=None)


@pytest.mark.parametrize("name", ["qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_shipped_config_has_transformers_parameter_count(name):
  """Our parameter count at real size equals transformers' for the config we would export
  (built on the meta device: no memory), so the shipped shapes are the model's."""
  from jaxpar.config import load_config
  from jaxpar.convert.hf import hf_config_from_model
  from jaxpar.runtime import abstract_model, count_params
  model = load_config(name).model
  hf_config = hf_config_from_model(model, "bfloat16")
  assert hf_config["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
  with torch.device("meta"):
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
  assert count_params(abstract_model(model)[1]) == sum(p.numel() for p in hf_model.parameters())


def test_a_pipeline_over_a_hybrid_stack_refuses_in_one_line():
  from jaxpar.parallel import ParallelPlan
  with pytest.raises(ConfigError, match="pipelining a hybrid stack is not built yet"):
    ParallelPlan.of(MeshConfig(stage=2)).check(HYBRID.model_copy(update={"num_layers": 4}))


def _linear_only_collectives(seq_len: int) -> list:
  """The collectives of a train step of a model of Gated DeltaNet layers only, its sequence
  split 4 ways over `context` (nothing else split), at `seq_len` tokens."""
  from jaxpar.aot import hlo
  model = Qwen35Config(**{**HYBRID.model_dump(), "layer_pattern": [{"mixer": "gated_deltanet"}],
                          "max_seq_len": seq_len})
  runtime = Runtime(model, MeshConfig(context=4, fsdp=1), jax.devices()[:4])
  batch = synthetic_batch(small_config(data={"global_batch_size": 2, "seq_len": seq_len}), documents_per_row=2)
  step = jax.jit(make_gradients(lm_loss(runtime.graphdef, z_loss=1e-4, logits_chunk_len=0), microbatches=1))
  params, _ = runtime.init()
  with runtime.context():
    compiled = step.lower(params, batch).compile()
  return hlo.collectives(compiled.as_text(), cpu=True)


def test_linear_layers_move_states_not_sequences_over_context():
  """LASP-2: under context parallelism the collectives in the layer loop (convolution tails,
  piece states, and their gradients) are the same bytes at 64 and at 128 tokens; softmax
  attention's key and value gathers would double. (Outside the loop, the step's zig-zag
  reordering of the tokens and the loss move per-token data, as for any model.)"""
  short, long = (_linear_only_collectives(n) for n in (64, 128))
  per_layer = lambda found: sorted((c.kind, c.bytes) for c in found if c.count == HYBRID.num_layers)  # noqa: E731
  assert sum(b for kind, b in per_layer(short) if kind == "all-gather") > 0
  assert per_layer(long) == per_layer(short)
