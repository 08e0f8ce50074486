"""Decode bursts (`Engine(decode_burst=K)`: K decode steps per device call) give exactly the
tokens and log-probabilities of one step per call, with requests ending inside a burst,
sampled rows, and requests queueing for slots; and they fall back to single steps where a
request needs the host between tokens."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.inference import SamplingParams
from tests.test_engine import NO_STOP, _engine, _prompts

BURST = 4


@pytest.fixture(scope="module")
def engines():
  single = _engine({"fsdp": 1}, jax.devices()[:1])
  bursting = _engine({"fsdp": 1}, jax.devices()[:1], decode_burst=BURST)
  bursting.params = single.params  # the same weights
  return single, bursting


def _requests(single):
  """Six requests for four slots: greedy and sampled, lengths that are no multiple of the
  burst, and one whose stop token (taken from its own greedy output) falls inside a burst."""
  prompts = _prompts([5, 9, 17, 30, 3, 12], seed=3)
  free_run = single.generate(prompts[:1], SamplingParams(max_tokens=12, **NO_STOP))[0].tokens
  stop = free_run[6]  # the 7th token: after a first single step, inside the second burst
  settings = [SamplingParams(max_tokens=12, stop_token_ids=(stop,)),
              SamplingParams(max_tokens=13, **NO_STOP),
              SamplingParams(max_tokens=9, temperature=1.0, seed=7, **NO_STOP),
              SamplingParams(max_tokens=21, temperature=0.8, top_k=20, seed=1, **NO_STOP),
              SamplingParams(max_tokens=6, stop=("zz",), **NO_STOP),
              SamplingParams(max_tokens=17, temperature=1.0, top_p=0.9, seed=2, **NO_STOP)]
  return prompts, [dataclasses.replace(s, logprobs=True) for s in settings], free_run


def test_bursts_give_the_tokens_of_single_steps(engines):
  single, bursting = engines
  prompts, settings, free_run = _requests(single)
  want = single.generate(prompts, settings)
  before = dict(bursting.stats)
  got = bursting.generate(prompts, settings)
  for w, g in zip(want, got):
    assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
    np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-6)
  assert got[0].finish_reason == "stop" and len(got[0].tokens) < len(free_run), "the stop ends it mid-burst"
  assert bursting.stats["decode_bursts"] > before.get("decode_bursts", 0)
  assert bursting.pool.free == bursting.pool.num_pages, "every page comes back"


def test_bursts_wait_for_requests_that_need_the_host(engines):
  """A request that adjusts logits (here a logit bias) decodes one step per call, and still
  gets what single steps give."""
  single, bursting = engines
  prompts = _prompts([6, 11])
  settings = [SamplingParams(max_tokens=10, **NO_STOP),
              SamplingParams(max_tokens=10, logit_bias=((65, 5.0),), **NO_STOP)]
  before = bursting.stats["decode_bursts"]
  got = bursting.generate(prompts, settings)
  assert [g.tokens for g in got] == [w.tokens for w in single.generate(prompts, settings)]
  assert bursting.stats["decode_bursts"] == before


def test_a_burst_below_one_is_refused():
  with pytest.raises(ConfigError, match="decode_burst=0"):
    _engine({"fsdp": 1}, jax.devices()[:1], decode_burst=0)
