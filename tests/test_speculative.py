"""Speculative decoding: greedy output is exactly the target's, and sampled output follows
the target's distribution (chi-square tests with fixed seeds, tiny vocabularies)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import MeshConfig, ModelConfig
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams
from jaxpar.inference.speculative import SpeculativeDecoder, verify
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL

# Chi-square 99.9% quantiles: a correct sampler fails these once in a thousand seeds.
CHI2_999 = {15: 37.70, 5: 20.52}


def _chi2(counts, probs):
  expected = probs * counts.sum()
  keep = expected > 0
  assert counts[~keep].sum() == 0, "a token with zero probability was drawn"
  return float(np.sum((counts[keep] - expected[keep]) ** 2 / expected[keep])), int(keep.sum()) - 1


def test_verify_outputs_follow_the_target_distribution():
  rng = np.random.default_rng(0)
  rows, k, vocab = 20000, 3, 6
  p = rng.dirichlet(np.ones(vocab), size=k + 1).astype(np.float32)
  q = rng.dirichlet(np.ones(vocab), size=k).astype(np.float32)
  proposed = np.stack([rng.choice(vocab, rows, p=q[j]) for j in range(k)], axis=1).astype(np.int32)
  settings = {"temperature": np.ones(rows, np.float32), "top_k": np.zeros(rows, np.int32),
              "top_p": np.ones(rows, np.float32), "seed": np.arange(rows, dtype=np.uint32)}
  positions = np.broadcast_to(np.arange(1, k + 2, dtype=np.int32), (rows, k + 1))
  accepted, bonus = map(np.asarray, verify(jnp.broadcast_to(p, (rows, k + 1, vocab)),
                                           jnp.broadcast_to(q, (rows, k, vocab)), proposed, settings, positions))
  first = np.where(accepted >= 1, proposed[:, 0], bonus)
  statistic, df = _chi2(np.bincount(first, minlength=vocab), p[0])
  assert statistic < CHI2_999[df], statistic
  # Given the first was kept, the second follows the target's second distribution too.
  kept = accepted >= 1
  second = np.where(accepted[kept] >= 2, proposed[kept, 1], bonus[kept])
  statistic, df = _chi2(np.bincount(second, minlength=vocab), p[1])
  assert statistic < CHI2_999[df], statistic
  assert 0 < accepted.mean() < k  # some proposals kept, some rejected: both paths ran


def _engine(vocab, seed, **model):
  config = ModelConfig(**{**SMALL_MODEL, "max_seq_len": 64, "vocab_size": vocab, **model})
  runtime = Runtime(config, MeshConfig(fsdp=1), jax.devices()[:1], seed=seed)
  params, model_state = runtime.init()
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=8, page_size=8,
                prefill_chunks=(8,))


def test_greedy_speculative_equals_target_alone():
  target = _engine(512, 0)
  prompts = [[1, 2, 3], list(range(40, 60)), [7] * 9]
  settings = SamplingParams(max_tokens=15, stop_token_ids=())
  alone = [r.tokens for r in target.generate(prompts, settings)]
  for draft, expect_all in ((_engine(512, 1, num_layers=1), False), (target, True)):
    decoder = SpeculativeDecoder(target, draft, k=3)
    assert [r.tokens for r in decoder.generate(prompts, settings)] == alone
    stats = decoder.stats
    assert stats.tokens == 3 * 15 and stats.tokens_per_target_step >= 1
    assert (stats.acceptance_rate == 1.0) == expect_all, stats
  assert target.pool.free == target.pool.num_pages


@pytest.mark.slow
def test_sampled_speculative_matches_the_target_distribution():
  vocab = 16
  target, draft = _engine(vocab, 0), _engine(vocab, 5, num_layers=1)
  prompt = [3, 1, 4]
  decoder = SpeculativeDecoder(target, draft, k=2)
  draws = []
  for start in range(0, 640, 8):
    results = decoder.generate([prompt] * 8, [SamplingParams(max_tokens=2, temperature=1.0, seed=start + i,
                                                             stop_token_ids=()) for i in range(8)])
    draws += [r.tokens for r in results]
  draws = np.asarray(draws)
  # Exact target distributions: p(t1 | prompt) and the marginal of t2.
  logits_of = jax.jit(lambda tokens: target.runtime.merge(target.params)(tokens)[0][:, -1])
  p1 = np.asarray(jax.nn.softmax(logits_of(jnp.asarray([prompt])))[0], np.float64)
  p2_given = np.asarray(jax.nn.softmax(logits_of(jnp.asarray([prompt + [t] for t in range(vocab)]))), np.float64)
  for column, probs in ((0, p1), (1, p1 @ p2_given)):
    statistic, df = _chi2(np.bincount(draws[:, column], minlength=vocab), probs / probs.sum())
    assert statistic < CHI2_999[df], (column, statistic)
  assert 0 < decoder.stats.acceptance_rate < 1
