"""Automatic prefix caching: 32 requests sharing a 200-token prefix compute it about once,
give the same tokens as without the cache (float and int8 caches), leave no page held,
and stay right when the pool is too small to keep everything (evictions, preemptions).

One engine per cache kind serves both runs: the cache is switched off and on between them
(`engine.sharing.enabled`), so the outputs compared come from the same compiled programs."""

import jax
import numpy as np
import pytest

from jaxpar.config import MeshConfig, ModelConfig
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL

MODEL = ModelConfig(**{**SMALL_MODEL, "max_seq_len": 256})
SETTINGS = SamplingParams(max_tokens=6, stop_token_ids=())
rng = np.random.default_rng(0)
PREFIX = rng.integers(0, 256, 200).tolist()
PROMPTS = [PREFIX + rng.integers(0, 256, 5).tolist() for _ in range(32)]


@pytest.fixture(scope="module")
def weights():
  runtime = Runtime(MODEL, MeshConfig(fsdp=1), jax.devices()[:1])
  return runtime, *runtime.init()


def _engine(weights, **options):
  runtime, params, model_state = weights
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=8, page_size=8,
                prefill_chunks=(16, 64), **options)


@pytest.fixture(scope="module")
def engines(weights):
  """{kv_cache: engine}, built on first use."""
  built = {}

  def get(kv_cache):
    if kv_cache not in built:
      built[kv_cache] = _engine(weights, kv_cache=kv_cache)
    return built[kv_cache]
  return get


def _without_cache(engine, prompts):
  engine.sharing.enabled = False
  try:
    return [r.tokens for r in engine.generate(prompts, SETTINGS)]
  finally:
    engine.sharing.enabled = True


def _no_page_held(engine):
  assert not engine.pool.holders.any() and engine.pool.free == engine.pool.num_pages


@pytest.mark.parametrize("kv_cache", ["float", "int8"])
def test_a_shared_prefix_is_computed_once_with_the_same_outputs(engines, kv_cache):
  engine = engines(kv_cache)
  expected = _without_cache(engine, PROMPTS)
  saved = engine.stats["prefill_tokens"]
  assert saved == 32 * 204 and engine.pool.cached == 0  # nothing was indexed while off
  engine.stats.clear()
  assert [r.tokens for r in engine.generate(PROMPTS, SETTINGS)] == expected
  computed = engine.stats["prefill_tokens"]
  assert saved >= 5 * computed, (saved, computed)
  assert engine.stats["prefix_cache_hits"] >= 31 * 200 and engine.stats["prefix_cache_queries"] == 32 * 204
  _no_page_held(engine)
  assert engine.pool.cached >= 25  # the prefix's pages stay cached for the next request
  again = engine.generate(PROMPTS[:4], SETTINGS)  # now every request finds it
  assert [r.tokens for r in again] == expected[:4] and engine.stats["prefill_tokens"] == computed + 4 * 4
  _no_page_held(engine)


def test_eviction_under_memory_pressure_keeps_outputs_right(weights, engines):
  """Three 120-token prefixes in turn through a pool that holds one sequence and a few
  pages more, on the quantized cache (whose tail pages make reuse the subtler case)."""
  prefixes = [rng.integers(0, 256, 120).tolist() for _ in range(3)]
  prompts = [prefixes[i % 3] + rng.integers(0, 256, 9).tolist() for i in range(12)]
  expected = _without_cache(engines("int8"), prompts)
  tight = _engine(weights, kv_cache="int8", num_pages=40)  # one sequence's 32 pages and a few more
  assert [r.tokens for r in tight.generate(prompts, SETTINGS)] == expected
  assert tight.pool.evictions > 0 and tight.stats["preemptions"] > 0 and tight.stats["prefix_cache_hits"] > 0
  _no_page_held(tight)


def test_on_cpu_a_request_grows_into_the_pages_after_its_cached_prefix(engines):
  """CPU decode gathers every page of every row each step, faster when each row's pages are
  consecutive: a request that takes a cached prefix then grows into the pages after it,
  though they hold cached blocks of their own (pages.PagePool.cached_yield_to_order)."""
  engine = engines("float")
  prompts = [rng.integers(0, 256, 30).tolist() for _ in range(8)]
  settings = SamplingParams(max_tokens=20, stop_token_ids=())
  expected = [r.tokens for r in engine.generate(prompts, settings)]  # their blocks stay cached
  tables, run = [], engine.programs.run

  def recording(kind, params, model_state, cache, tokens, positions, table, *rest):
    if kind == "step":
      tables.append((np.asarray(positions)[:, 0], np.asarray(table)))
    return run(kind, params, model_state, cache, tokens, positions, table, *rest)
  engine.programs.run = recording
  try:
    assert [r.tokens for r in engine.generate(prompts, settings)] == expected
  finally:
    del engine.programs.run  # the instance attribute: back to the method
  assert engine.stats["prefix_cache_hits"] > 0 and tables
  for positions, table in tables:
    for position, row in zip(positions, table):
      pages = row[:position // engine.pool.page_size + 1]
      assert position < 0 or (np.diff(pages) == 1).all(), pages
  _no_page_held(engine)
