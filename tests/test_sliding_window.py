"""A Mistral-style sliding window shorter than the sequence (with a Gemma-style logit
soft-cap), end to end: the same logits in the training forward (context-parallel ring,
zig-zag), the chunked kernel and a full forward; the engine's paged decode (float and int8
pages) greedy past the window equal to full recomputation while each sequence holds about
window / page_size + 1 pages; and a Hugging Face Mistral with a window imported, generated
from and exported exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import MeshConfig, ModelConfig
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams
from jaxpar.inference.pages import held_pages
from jaxpar.models.kv_cache_windowed import ring_pages
from jaxpar.models.kv_quant import KVQuantization
from jaxpar.pallas_kernels import unzigzag, zigzag
from jaxpar.parallel import ParallelConfig
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL

WINDOW, PAGE, LENGTH = 12, 4, 128
MODEL = ModelConfig(**{**SMALL_MODEL, "max_seq_len": LENGTH, "sliding_window": WINDOW,
                       "attn_logit_soft_cap": 2.0})
NO_STOP = dict(stop_token_ids=())


@pytest.fixture(scope="module")
def run():
  runtime = Runtime(MODEL, MeshConfig(fsdp=1), jax.devices()[:1])
  params, model_state = runtime.init()
  return runtime, params, model_state


def _logits(runtime, params, tokens, kv_quantization=None):
  with runtime.context():
    run = jax.jit(lambda p, t: runtime.merge(p)(t, kv_quantization=kv_quantization)[0])
    return np.asarray(run(params, tokens))


def test_training_forward_chunked_and_full_forward_agree(run):
  runtime, params, _ = run
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 258, (2, 64)), jnp.int32)
  want = _logits(runtime, params, tokens)
  variant = lambda **update: Runtime(MODEL.model_copy(update=update), MeshConfig(fsdp=1), jax.devices()[:1])
  full = _logits(variant(sliding_window=None), params, tokens)
  np.testing.assert_allclose(full[:, :WINDOW], want[:, :WINDOW], rtol=1e-5, atol=1e-5)
  assert not np.allclose(full[:, WINDOW:], want[:, WINDOW:], atol=1e-3)  # the window matters
  assert not np.allclose(_logits(variant(attn_logit_soft_cap=None), params, tokens), want, atol=1e-3)
  np.testing.assert_allclose(_logits(variant(attention="chunked"), params, tokens), want, rtol=1e-5, atol=1e-5)
  # As the train step runs it: the sequence split over 4 context devices in zig-zag order, ring attention.
  ring = Runtime(MODEL, MeshConfig(context=4, fsdp=2), jax.devices(),
                 parallel=ParallelConfig(context={"attention": "ring", "load_balance": True}))
  positions = jnp.broadcast_to(jnp.arange(64), tokens.shape)

  def train_forward(params, tokens, positions):
    return ring.merge(params)(zigzag(tokens, 4), zigzag(positions, 4), zigzag=True)[0]
  with ring.context():
    got = jax.jit(train_forward)(jax.device_put(params, ring.param_shardings), tokens, positions)
  np.testing.assert_allclose(unzigzag(np.asarray(got), 4), want, rtol=1e-5, atol=1e-5)


def _greedy_matches_recompute(runtime, params, prompt, generated, kv_quantization=None):
  """Every generated token is the argmax of a full forward over what precedes it."""
  sequence = np.zeros((1, LENGTH), np.int32)
  sequence[0, :len(prompt) + len(generated)] = prompt + generated
  logits = _logits(runtime, params, sequence, kv_quantization)[0]
  start = len(prompt) - 1
  return np.argmax(logits[start:start + len(generated)], axis=-1).tolist() == generated


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_engine_decodes_past_the_window_on_a_bounded_number_of_pages(run, kv_cache):
  runtime, params, model_state = run
  # A pool of 24 pages for 2 slots, less than one sequence at max_seq_len (32 pages): only
  # a prompt chunk and its window (at most 12 pages) must fit at once.
  engine = Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=2, page_size=PAGE,
                  num_pages=24, prefill_chunks=(8, 32), kv_cache=kv_cache)
  prompts = [np.random.default_rng(1).integers(0, 256, n).tolist() for n in (5, 40)]
  requests = [engine.submit(p, SamplingParams(max_tokens=80, **NO_STOP)) for p in prompts]
  most = 0
  while any(r.finish_reason is None for r in requests):
    engine.step()
    most = max([most] + [held_pages(r.pages) for r in requests if r.finish_reason is None and not r.prefilling])
  assert most == WINDOW // PAGE + 1 and engine.stats["preemptions"] == 0
  assert engine.pool.free == engine.pool.num_pages
  spec = None if kv_cache is None else KVQuantization(kv_cache, PAGE, 0)  # as the engine stores it
  for prompt, request in zip(prompts, requests):
    assert len(request.generated) == 80
    assert _greedy_matches_recompute(runtime, params, prompt, request.generated, spec)


# Local, global, local: the local layers' caches are rings of their window's pages per slot.
MIXED = ModelConfig(**{**SMALL_MODEL, "num_layers": 3, "max_seq_len": LENGTH, "sliding_window": WINDOW,
                       "layer_pattern": [{}, {"sliding_window": None}]})


@pytest.fixture(scope="module")
def mixed():
  runtime = Runtime(MIXED, MeshConfig(fsdp=1), jax.devices()[:1])
  return runtime, runtime.init()[0]


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_mixed_model_keeps_only_the_windows_pages_on_local_layers(mixed, kv_cache):
  runtime, params = mixed
  engine = Engine(runtime, params, ByteTokenizer(), slots=2, page_size=PAGE, prefill_chunks=(8, 32),
                  kv_cache=kv_cache)
  ring = ring_pages(WINDOW, PAGE)
  assert engine.chunks == [8, WINDOW] and ring == 7 and not engine.sharing.enabled
  # The pool holds the global layer only; the two local layers hold 2 slots x 7 pages each.
  pool, rings = engine.cache["layers"]["full"], engine.cache["layers"]["windowed"]
  assert {x.shape[:3] for x in jax.tree.leaves(pool) if x.shape[2] != 2} == {(1, 2, engine.pool.num_pages)}
  assert {x.shape[:3] for x in jax.tree.leaves(rings) if x.shape[2] != 2} == {(2, 2, 2 * ring)}
  if kv_cache is None:  # 2 (k, v) x 2 kv heads x 16 head_dim x 4 bytes per layer, page position
    per_page = 2 * 2 * 16 * 4 * PAGE
    assert engine.cache_bytes == {"pool": per_page * engine.pool.num_pages, "rings": 2 * per_page * 2 * ring,
                                  "states": 0}
  prompts = [np.random.default_rng(3).integers(0, 256, n).tolist() for n in (5, 40)]
  requests = [engine.submit(p, SamplingParams(max_tokens=70, logprobs=True, **NO_STOP)) for p in prompts]
  most = 0
  while any(r.finish_reason is None for r in requests):
    engine.step()
    most = max([most] + [held_pages(r.pages) for r in requests if r.finish_reason is None])
    assert all(held_pages(r.pages) == len(r.pages) for r in requests)  # the global layer keeps every page
  # Seen last holding 109 positions: the last step writes position 108 (its token ends the
  # request), and its page is taken while the step before runs (the engine runs ahead).
  assert most == -(-109 // PAGE) and engine.pool.free == engine.pool.num_pages
  spec = None if kv_cache is None else KVQuantization(kv_cache, PAGE, 0)
  sequences = np.zeros((2, LENGTH), np.int32)  # up to 110 positions: the rings went round 4 times
  for row, (prompt, request) in enumerate(zip(prompts, requests)):
    sequences[row, :len(prompt) + 70] = prompt + request.generated
  logits = _logits(runtime, params, sequences, spec).astype(np.float32)
  for row, (prompt, request) in enumerate(zip(prompts, requests)):
    generated = np.arange(len(prompt) - 1, len(prompt) + 69)
    if kv_cache is None:  # greedy: each token the argmax of a full forward over what precedes it
      assert np.argmax(logits[row, generated], axis=-1).tolist() == request.generated
    # int8: the engine and the simulated quantized forward differ by ~0.02 here with or
    # without rings (the pool layout gives the same logprobs bit for bit); a stale ring page
    # would be far off.
    want = np.asarray(jax.nn.log_softmax(logits[row, generated]))[np.arange(70), request.generated]
    np.testing.assert_allclose(request.logprobs, want, atol=1e-4 if kv_cache is None else 0.05)


# -- Hugging Face Mistral with a sliding window ------------------------------------------

@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from jaxpar.convert.hf import hf_to_jaxpar
  from tests.test_hf import SMALL, _random_hf_model
  directory = tmp_path_factory.mktemp("mistral")
  model = _random_hf_model(transformers.MistralConfig(**SMALL, sliding_window=8), directory / "hf")
  config = hf_to_jaxpar(directory / "hf", directory / "jaxpar")
  return torch, transformers, model, config, directory


def test_mistral_window_imports_with_logits_parity_and_exports(mistral):
  torch, transformers, model, config, directory = mistral
  from jaxpar.convert.hf import jaxpar_to_hf
  from tests.test_hf import _hf_logits, _our_logits
  assert config.model.sliding_window == 8 and config.model.max_seq_len == 64  # no longer cut to the window
  tokens = np.random.default_rng(0).integers(0, 320, (2, 40))
  expected = _hf_logits(model, tokens)
  np.testing.assert_allclose(_our_logits(directory / "jaxpar", config, tokens), expected, rtol=1e-5,
                             atol=1e-5 * np.abs(expected).max())
  jaxpar_to_hf(directory / "jaxpar", directory / "back")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory / "back").eval()
  assert (reloaded.config.model_type, reloaded.config.sliding_window) == ("mistral", 8)
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens), expected)


def test_mistral_window_generates_like_transformers(mistral):
  torch, _, model, _, directory = mistral
  prompt = np.random.default_rng(2).integers(0, 320, 10).tolist()
  with torch.no_grad():
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=48, min_new_tokens=48, do_sample=False)
  engine = Engine.from_checkpoint(directory / "jaxpar", mesh={"data": 1, "fsdp": 1}, devices=jax.devices()[:1],
                                  tokenizer=ByteTokenizer(), slots=1, page_size=PAGE, prefill_chunks=(8,))
  ours = engine.generate([prompt], SamplingParams(max_tokens=48, **NO_STOP))[0].tokens
  assert ours == hf[0, len(prompt):].tolist()  # 48 tokens, 40 of them past the window of 8
