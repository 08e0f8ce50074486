"""Automatic prefix caching: 32 requests sharing a 200-token prefix compute it about once,
give the same tokens as without the cache (float and int8 caches), leave no page held,
and stay right when the pool is too small to keep everything (evictions, preemptions)."""

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


def _no_page_held(engine):
  assert not engine.pool.holders.any() and engine.pool.free == engine.pool.num_pages


@pytest.mark.parametrize("kv_cache", ["float", "int8"])
def test_a_shared_prefix_is_computed_once_with_the_same_outputs(weights, kv_cache):
  off, on = _engine(weights, kv_cache=kv_cache, prefix_caching=False), _engine(weights, kv_cache=kv_cache)
  expected = [r.tokens for r in off.generate(PROMPTS, SETTINGS)]
  assert [r.tokens for r in on.generate(PROMPTS, SETTINGS)] == expected
  computed, saved = on.stats["prefill_tokens"], off.stats["prefill_tokens"]
  assert saved == 32 * 204 and saved >= 5 * computed, (saved, computed)
  assert on.stats["prefix_cache_hits"] >= 31 * 200 and on.stats["prefix_cache_queries"] == 32 * 204
  _no_page_held(on)
  assert on.pool.cached >= 25  # the prefix's pages stay cached for the next request
  again = on.generate(PROMPTS[:4], SETTINGS)  # now every request finds it
  assert [r.tokens for r in again] == expected[:4] and on.stats["prefill_tokens"] == computed + 4 * 4
  _no_page_held(on)


def test_eviction_under_memory_pressure_keeps_outputs_right(weights):
  prefixes = [rng.integers(0, 256, 120).tolist() for _ in range(3)]
  prompts = [prefixes[i % 3] + rng.integers(0, 256, 9).tolist() for i in range(12)]
  expected = [r.tokens for r in _engine(weights, prefix_caching=False).generate(prompts, SETTINGS)]
  tight = _engine(weights, num_pages=40)  # one sequence's 32 pages and a few more
  assert [r.tokens for r in tight.generate(prompts, SETTINGS)] == expected
  assert tight.pool.evictions > 0 and tight.stats["prefix_cache_hits"] > 0
  _no_page_held(tight)
