"""The generation engine: cached decoding equals full recomputation, results do not depend
on what else is in the batch, nothing leaks, and nothing recompiles in steady state."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import MeshConfig, ModelConfig
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams, pages
from jaxpar.inference.pages import table_widths
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL, counting_compiles

MODEL = ModelConfig(**{**SMALL_MODEL, "max_seq_len": 96})
NEW_TOKENS = 10
NO_STOP = dict(stop_token_ids=())


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, n).tolist() for n in lengths]


def _engine(mesh: dict, devices, **options):
  runtime = Runtime(MODEL, MeshConfig(**mesh), devices)
  params, model_state = runtime.init()
  options = {"slots": 4, "page_size": 8, "prefill_chunks": (8, 32), **options}
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, **options)


def _recompute_greedy(engine, prompt, count):
  """Greedy continuation by running the whole sequence through the model at every step. The
  sequence is padded to the model's length after its end, which causal attention never
  reads from earlier positions: one compiled forward for every length."""
  model = jax.device_get(engine.params)
  logits_of = jax.jit(lambda params, tokens, last: engine.runtime.merge(params)(tokens)[0][0, last])
  tokens = list(prompt)
  for _ in range(count):
    padded = np.zeros((1, MODEL.max_seq_len), np.int32)
    padded[0, :len(tokens)] = tokens
    tokens.append(int(jnp.argmax(logits_of(model, padded, len(tokens) - 1))))
  return tokens[len(prompt):]


@pytest.fixture(scope="module")
def one_device():
  return _engine({"fsdp": 1}, jax.devices()[:1])


@pytest.fixture(scope="module")
def sharded():
  """8 devices: batch rows over data, kv heads (2) and heads over tensor."""
  return _engine({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices())


@pytest.fixture(scope="module")
def heads_repeated():
  """tensor=4 over 2 kv heads: the cache keeps each head twice, one per device."""
  return _engine({"data": 2, "fsdp": 1, "tensor": 4}, jax.devices())


LENGTHS = [1, 7, 8, 9, 33, 70]  # inside a page, page edges, across chunks and pages


@pytest.mark.parametrize("which", ["one_device", "sharded", "heads_repeated"])
def test_cached_greedy_equals_recompute(which, request):
  engine = request.getfixturevalue(which)
  pages = jax.tree.leaves(engine.cache)[0]  # [layers, kv heads kept, pages, page size, head_dim]
  tensor = engine.runtime.mesh.shape["tensor"]
  assert (engine.kv_repeat, pages.shape[1]) == ((2, 4) if tensor == 4 else (1, MODEL.num_kv_heads))
  assert pages.sharding.shard_shape(pages.shape)[1] == MODEL.num_kv_heads * engine.kv_repeat // tensor
  prompts = _prompts(LENGTHS)
  results = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, **NO_STOP))
  for prompt, result in zip(prompts, results):
    assert result.finish_reason == "length" and len(result.tokens) == NEW_TOKENS
    assert result.tokens == _recompute_greedy(engine, prompt, NEW_TOKENS), len(prompt)
  assert engine.pool.free == engine.pool.num_pages and not any(engine.slots)


def test_continuous_batching_results_do_not_depend_on_the_batch(one_device):
  engine = one_device
  rng = random.Random(0)
  prompts = _prompts([rng.randint(1, 60) for _ in range(12)], seed=1)
  settings = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]),
                             top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]), seed=i, **NO_STOP)
              for i in range(len(prompts))]
  alone = [engine.generate([p], s)[0].tokens for p, s in zip(prompts, settings)]
  # The same requests arriving at random moments while others run.
  order = list(range(len(prompts)))
  rng.shuffle(order)
  requests = {}
  while order or any(r.finish_reason is None for r in requests.values()):
    for _ in range(rng.randint(0, 3)):
      if order:
        i = order.pop()
        requests[i] = engine.submit(prompts[i], settings[i])
    engine.step()
  assert [requests[i].generated for i in range(len(prompts))] == alone
  assert engine.pool.free == engine.pool.num_pages and not any(engine.slots) and not engine.waiting


def test_preemption_recomputes_the_same_tokens():
  # A pool of 2 sequences' pages for 4 slots: growth forces the newest requests out and back.
  engine = _engine({"fsdp": 1}, jax.devices()[:1], num_pages=24)
  prompts = _prompts([30, 40, 50, 60], seed=2)
  settings = SamplingParams(max_tokens=30, temperature=0.7, seed=3, **NO_STOP)
  together = engine.generate(prompts, settings)
  assert engine.stats["preemptions"] > 0
  alone = [engine.generate([p], settings)[0] for p in prompts]
  assert [r.tokens for r in together] == [r.tokens for r in alone]
  assert engine.pool.free == engine.pool.num_pages


def test_running_ahead_gives_the_tokens_of_one_step_at_a_time(one_device):
  """Steps dispatched before the last one's tokens are read (run_ahead) give the same tokens
  as reading every step first, while requests stop on a token at different steps (their
  pages freed with a step still writing to them, and taken by others), and new ones arrive
  mid-way; and the engine did run ahead."""
  engine = one_device
  prompts = _prompts([5, 12, 20, 9, 30, 3], seed=4)
  free = engine.generate(prompts, SamplingParams(max_tokens=16, **NO_STOP))
  # Each request stops on a token it would generate at a different step (if it appears earlier, there).
  settings = [SamplingParams(max_tokens=16, temperature=0.8 * (i % 2), seed=i,
                             stop_token_ids=(result.tokens[3 + 2 * i] if 3 + 2 * i < 16 else 0,))
              for i, result in enumerate(free)]

  def run():
    requests = [engine.submit(p, s) for p, s in zip(prompts[:4], settings[:4])]
    steps = 0
    while any(r.finish_reason is None for r in requests):
      engine.step()
      steps += 1
      if steps == 6:  # two more arrive while the first four run
        requests += [engine.submit(p, s) for p, s in zip(prompts[4:], settings[4:])]
    return [(r.generated, r.finish_reason) for r in requests]
  before = engine.stats["decode_steps_ahead"]
  ahead = run()
  assert engine.stats["decode_steps_ahead"] > before
  engine.run_ahead = False
  try:
    assert run() == ahead
  finally:
    engine.run_ahead = True
  assert sum(reason == "stop" for _, reason in ahead) >= 3
  assert engine.pool.free == engine.pool.num_pages and not any(engine.slots)


def test_requests_arriving_while_a_step_runs_ahead_can_preempt_its_rows():
  """A request that arrives while a step runs ahead, and whose prompt takes pages from a
  running row (preempting it), gets its tokens, and so does the preempted row: the same as
  each alone."""
  engine = _engine({"fsdp": 1}, jax.devices()[:1], num_pages=14)
  prompts = _prompts([30, 20, 60], seed=5)
  settings = SamplingParams(max_tokens=30, temperature=0.7, seed=6, **NO_STOP)
  requests = [engine.submit(p, settings) for p in prompts[:2]]
  steps = 0
  while any(r.finish_reason is None for r in requests):
    engine.step()
    steps += 1
    if steps == 5:
      assert engine._ahead is not None, "the first two run ahead before the others arrive"
      requests.append(engine.submit(prompts[2], settings))
  assert engine.stats["preemptions"] > 0
  alone = [engine.generate([p], settings)[0].tokens for p in prompts]
  assert [r.generated for r in requests] == alone
  assert engine.pool.free == engine.pool.num_pages


def test_no_recompiles_after_warm_up(one_device):
  with counting_compiles() as compiles:
    one_device.generate(_prompts([3, 17, 64, 90 - NEW_TOKENS]), SamplingParams(max_tokens=NEW_TOKENS, **NO_STOP))
    one_device.generate(_prompts([5]), SamplingParams(max_tokens=3, temperature=1.0, top_p=0.5, logprobs=True))
  assert compiles == []


def test_stop_strings_tokens_and_logprobs(one_device):
  engine = one_device
  free = engine.generate(["ab"], SamplingParams(max_tokens=12, logprobs=True, **NO_STOP))[0]
  assert len(free.logprobs) == 12 and all(lp <= 0 for lp in free.logprobs)
  text = free.text
  assert len(text) >= 5, text  # enough text to stop inside it
  stop = text[3:5]
  stopped = engine.generate(["ab"], SamplingParams(max_tokens=12, stop=(stop,), **NO_STOP))[0]
  assert stopped.finish_reason == "stop" and stopped.text == text[:text.find(stop)]
  first = free.tokens[2]
  ended = engine.generate(["ab"], SamplingParams(max_tokens=12, stop_token_ids=(first,)))[0]
  assert ended.finish_reason == "stop" and ended.tokens == free.tokens[:2]


def test_logprobs_are_computed_for_the_rows_that_ask(one_device):
  """The step skips log-probabilities when no row asks: a batch where one row asks gives it
  the numbers it gets alone, and the other row none."""
  prompts, wanted = _prompts([6, 9], seed=3), SamplingParams(max_tokens=5, logprobs=True, **NO_STOP)
  alone = one_device.generate(prompts[:1], wanted)[0]
  mixed = one_device.generate(prompts, [wanted, SamplingParams(max_tokens=5, **NO_STOP)])
  assert mixed[0].tokens == alone.tokens and mixed[1].logprobs is None
  np.testing.assert_allclose(mixed[0].logprobs, alone.logprobs, rtol=1e-5, atol=1e-6)
  assert all(np.isfinite(alone.logprobs)) and all(lp <= 0 for lp in alone.logprobs)
  events = list(one_device.stream(prompts[1], SamplingParams(max_tokens=3, **NO_STOP)))
  assert [e.token for e in events] == mixed[1].tokens[:3] and all(e.logprob is None for e in events)


def test_bad_requests_are_clear_errors(one_device):
  with pytest.raises(ValueError, match="the prompt has 96 tokens but the context holds 96"):
    one_device.submit([1] * 96)
  with pytest.raises(ValueError, match="prompt is empty"):
    one_device.submit([])
  with pytest.raises(ValueError, match="top_p=1.5 must be in"):
    SamplingParams(top_p=1.5)


def test_a_mesh_that_splits_sequences_is_refused():
  with pytest.raises(ValueError, match="mesh.context=2: generation does not split sequences"):
    _engine({"context": 2, "fsdp": 1}, jax.devices()[:2])


def test_page_table_widths_halve_only_where_decode_gathers_every_page():
  assert table_widths(256, 16, gathers=True) == (32, 64, 128, 256)  # down to 512 positions
  assert table_widths(9, 16, gathers=True) == (9,)
  assert table_widths(256, 16, gathers=False) == (256,)  # the Pallas kernels read only what they need


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_decode_on_narrower_page_tables_gives_the_same_tokens(one_device, monkeypatch, kv_cache):
  # Widths 2, 3, 6 and 12 pages of 8: steps take narrower tables as the longest rows
  # finish, and wider ones as the others grow. Then the same requests on the widest only.
  monkeypatch.setattr(pages, "NARROWEST_TABLE", 16)
  engine = Engine(one_device.runtime, one_device.params, ByteTokenizer(), slots=4, page_size=8,
                  prefill_chunks=(32,), prefill_budget=32, kv_cache=kv_cache)
  assert engine.step_widths == (2, 3, 6, 12)
  widths, run = [], engine.programs.run
  engine.programs.run = lambda kind, *args: widths.append(args[5].shape[1]) or run(kind, *args)
  prompts = _prompts([3, 9, 20, 70])
  settings = [SamplingParams(max_tokens=n, **NO_STOP) for n in (14, 6, 6, 2)]
  narrow = [r.tokens for r in engine.generate(prompts, settings)]
  assert set(widths) == {2, 3, 6, 12}
  engine.step_widths, widths[:] = (12,), []
  assert [r.tokens for r in engine.generate(prompts, settings)] == narrow and set(widths) == {12}
  assert engine.pool.free == engine.pool.num_pages
