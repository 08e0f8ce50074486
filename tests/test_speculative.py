"""Speculative decoding, a mode of the engine: greedy output is exactly the target's, also with
requests arriving mid-round and rows preempted, and sampled output follows the target's
distribution (chi-square tests with fixed seeds, tiny vocabularies)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.config import MeshConfig, ModelConfig, load_config
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams
from jaxpar.errors import ConfigError, UserError
from jaxpar.inference.medusa import MedusaDraft
from jaxpar.inference.mtp import MtpDraft
from jaxpar.inference.draft_length import REFRESH, RowRate, WidthChooser, pass_widths
from jaxpar.inference.speculative import DraftModel, NgramDraft, ngram_lookup, page_room, verify
from jaxpar.models.medusa import fingerprint
from jaxpar.runtime import Runtime
from jaxpar.weights import split_weights
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


def test_verify_with_a_deterministic_draft_and_fewer_proposals_follows_the_target():
  """An n-gram draft's proposals (q one-hot at each), 0 to k of them per row: the first token
  still follows the target's distribution, and a row with none draws from it directly."""
  rng = np.random.default_rng(1)
  rows, k, vocab = 20000, 3, 6
  p = rng.dirichlet(np.ones(vocab), size=k + 1).astype(np.float32)
  proposed = rng.integers(0, vocab, (rows, k)).astype(np.int32)
  limit = rng.integers(0, k + 1, rows).astype(np.int32)
  settings = {"temperature": np.ones(rows, np.float32), "top_k": np.zeros(rows, np.int32),
              "top_p": np.ones(rows, np.float32), "seed": np.arange(rows, dtype=np.uint32)}
  positions = np.broadcast_to(np.arange(1, k + 2, dtype=np.int32), (rows, k + 1))
  accepted, bonus = map(np.asarray, verify(jnp.broadcast_to(p, (rows, k + 1, vocab)), None, proposed, settings,
                                           positions, limit))
  assert (accepted <= limit).all() and (accepted[limit == 0] == 0).all()
  first = np.where(accepted >= 1, proposed[:, 0], bonus)
  for chosen in (limit > 0, limit == 0):
    statistic, df = _chi2(np.bincount(first[chosen], minlength=vocab), p[0])
    assert statistic < CHI2_999[df], statistic
  assert 0 < accepted[limit > 0].mean() < limit[limit > 0].mean()


def test_the_pass_width_follows_acceptance_and_measured_cost():
  assert pass_widths(4) == (1, 2, 4) and pass_widths(1) == (1,) and pass_widths(5) == (1, 3, 5)
  chooser = WidthChooser(pass_widths(4))
  for width, seconds in ((4, 1.5), (2, 1.2), (1, 1.0)):  # each width run twice, widest first
    for _ in range(2):
      assert chooser.choose([0.5], 0) == width
      chooser.record(width, 9.0 if width not in chooser.seconds and not chooser.runs[width] else seconds)
  # Kept 9 times in 10: 4.10 tokens in 1.5 s beats 2.71 in 1.2 s and 1.9 in 1.0 s.
  assert chooser.choose([0.9], 0) == 4
  assert chooser.choose([0.1], 0) == 1 and chooser.choose([], 3) == 1  # rarely or never kept: the cheapest
  assert chooser.choose([0.6, 0.6], 0) == 2  # 3.92 tokens in 1.2 s: more per second than 4.61 in 1.5 s or 3.2 in 1.0 s
  chosen = []  # a width not run for REFRESH rounds runs once more: timed again, not judged on old timings
  for _ in range(2 * REFRESH):
    chosen.append(chooser.choose([0.1], 0))
    chooser.record(chosen[-1], {4: 1.5, 2: 1.2, 1: 1.0}[chosen[-1]])
  assert 1 <= chosen.count(4) <= 2 and 1 <= chosen.count(2) <= 2 and chosen.count(1) >= 2 * REFRESH - 4
  rate = RowRate()
  assert rate.rate() == 0.5
  rate.update(4, 4)  # all four kept
  assert rate.rate() == 5 / 6
  rate.update(4, 1)  # one kept, the second tried and rejected
  assert rate.rate() == pytest.approx((0.7 * 4 + 1 + 1) / (0.7 * 4 + 2 + 2))


def test_ngram_lookup_takes_the_longest_tail_that_occurred_and_its_latest_place():
  assert ngram_lookup([5, 1, 2, 9, 1, 2, 7, 8, 3, 1, 2], k=3, max_n=3) == [7, 8, 3]  # "1 2": latest is 4..5
  assert ngram_lookup([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], k=2, max_n=3) == [9, 2]  # "1 2 3" beats "2 3"
  assert ngram_lookup([4, 6, 4], k=4, max_n=3) == [6, 4]  # as many as follow
  assert ngram_lookup([1, 2, 3], k=4, max_n=3) == [] and ngram_lookup([7], k=4, max_n=3) == []
  assert ngram_lookup([1, 2, 8, 2], k=2, max_n=2, min_n=2) == []  # "8 2" never occurred; n=1 not allowed


def _engine(vocab, seed, slots=8, num_pages=None, draft=None, kv_cache=None, **model):
  config = ModelConfig(**{**SMALL_MODEL, "max_seq_len": 64, "vocab_size": vocab, **model})
  runtime = Runtime(config, MeshConfig(fsdp=1), jax.devices()[:1], seed=seed)
  params, model_state = runtime.init()
  if config.medusa is not None:  # random heads (a fresh one only repeats the model), stamped with their base
    params["medusa"]["w"] = jax.random.normal(jax.random.key(seed), params["medusa"]["w"].shape)
    model_state["medusa"]["base_fingerprint"] = fingerprint(split_weights(runtime, params)[1])
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=slots, page_size=8,
                prefill_chunks=(8,), num_pages=num_pages, speculative=draft, kv_cache=kv_cache)


def _mtp_engine(vocab, draft):
  """A DeepSeek-style target with its multi-token-prediction module (random weights)."""
  config = load_config("tiny-deepseek", ["model.attention_block=gqa", "model.num_layers=2", "model.max_seq_len=64",
                                         "data.seq_len=32", f"model.vocab_size={vocab}"]).model
  runtime = Runtime(config, MeshConfig(fsdp=1), jax.devices()[:1], seed=0)
  params, model_state = runtime.init()
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=8, page_size=8,
                prefill_chunks=(8,), speculative=draft)


PROMPTS = [[1, 2, 3], list(range(40, 60)), [7] * 9]
GREEDY_15 = SamplingParams(max_tokens=15, stop_token_ids=())


@pytest.fixture(scope="module")
def plain():
  """The target's own greedy tokens for PROMPTS (no draft)."""
  return [r.tokens for r in _engine(512, 0).generate(PROMPTS, GREEDY_15)]


def test_greedy_speculative_equals_target_alone(plain):
  """A weak draft (some proposals rejected) and the target as its own draft (all kept)."""
  for draft, expect_all in ((_engine(512, 1, num_layers=1), False), (_engine(512, 0), True)):
    target = _engine(512, 0, draft=DraftModel(draft, k=3))
    done = target.generate(PROMPTS, GREEDY_15)
    assert [r.tokens for r in done] == plain
    proposed, accepted = (target.stats[f"speculative_{x}"] for x in ("proposed", "accepted"))
    assert (accepted == proposed) == expect_all and accepted <= proposed, target.stats
    assert sum(r.draft_accepted for r in done) == accepted and sum(r.draft_proposed for r in done) == proposed
    # Every proposal kept: up to 4 tokens per target pass (at least ceil(15 / 4) passes a
    # prompt; fewer proposals in the rounds that measure the narrower passes), else 1.
    rounds = target.stats["speculative_rounds"]
    assert (3 * 4 <= rounds < 3 * 15) if expect_all else rounds == 3 * 15
    # A row's last round proposes no more than max_tokens leaves room for: every pass's tokens
    # are its accepted proposals and one of its own.
    assert rounds + accepted == 3 * 15
    assert target.pool.free == target.pool.num_pages and draft.pool.free == draft.pool.num_pages


def test_greedy_ngram_speculation_equals_target_alone(plain):
  """Prompt lookup: the repeated prompt's rows get proposals (some kept), the others few or none;
  every row's tokens are the target's own."""
  target = _engine(512, 0, draft=NgramDraft(k=3))
  done = target.generate(PROMPTS, GREEDY_15)
  assert [r.tokens for r in done] == plain
  proposed, accepted = (target.stats[f"speculative_{x}"] for x in ("proposed", "accepted"))
  assert 0 < accepted <= proposed, target.stats
  # Each kept proposal saves a pass (no round proposes more than its row has room for).
  assert target.stats["speculative_rounds"] == 3 * 15 - accepted
  assert sum(r.draft_proposed for r in done) == proposed


def test_a_pass_over_a_quantized_cache_stays_in_its_page_short_of_the_last_slot():
  # starts: where each row's next token goes; its last token is at starts - 1 (page_size 8).
  assert page_room([1, 4, 7, 8, 9, 16, 0], 8).tolist() == [6, 3, 0, 0, 6, 0, 6]


@pytest.mark.parametrize("kv_cache", ["int8", "int4"])
def test_greedy_speculation_over_a_quantized_cache_is_its_plain_decoding(kv_cache):
  """Drafts that would run over page ends (the target as its own draft keeps every one) and
  n-gram lookup, over a quantized cache: exactly the tokens plain decoding over it gives,
  which the quantization changes (so reading a page float or quantized would show)."""
  settings = SamplingParams(max_tokens=30, stop_token_ids=())
  # Each engine compiles its programs when built: the plain ones serve as the drafts too.
  quantized, float_cache = _engine(512, 0, kv_cache=kv_cache), _engine(512, 0)
  want = [r.tokens for r in quantized.generate(PROMPTS, settings)]
  if kv_cache == "int4":
    assert want != [r.tokens for r in float_cache.generate(PROMPTS, settings)]
  for draft in (DraftModel(float_cache, k=3), NgramDraft(k=3)):
    target = _engine(512, 0, draft=draft, kv_cache=kv_cache)
    assert [r.tokens for r in target.generate(PROMPTS, settings)] == want, type(draft).__name__
    assert target.stats["speculative_accepted"] > 0 and target.pool.free == target.pool.num_pages
  with pytest.raises(ConfigError, match="give the draft engine a float cache"):
    _engine(512, 0, draft=DraftModel(quantized, k=3))


class _EveryThirdWrong(NgramDraft):
  """Proposes the tokens plain decoding gives next (`want`, by prompt), every third one
  changed: some drafts are kept, then one is rejected, again and again."""

  def __init__(self, want: dict, k: int = 3):
    super().__init__(k=k)
    self.want = want

  def propose(self, rows, starts, settings):
    proposed, limit = np.zeros((self.batch, self.k), np.int32), np.zeros(self.batch, np.int32)
    for i, request in enumerate(rows):
      if request is not None:
        done, following = len(request.generated), self.want[tuple(request.prompt)]
        drafts = [t if (done + j) % 3 != 2 else (t + 1) % 512 for j, t in enumerate(following[done:done + self.k])]
        proposed[i, :len(drafts)], limit[i] = drafts, len(drafts)
    return proposed, limit, None


def test_speculation_rolls_linear_attention_states_back_to_the_last_kept_draft():
  """A Qwen3.5-style hybrid (Gated DeltaNet layers keep one state per sequence): drafts kept
  and then rejected in turn leave each row's state where its last kept token left it, so the
  tokens are plain decoding's (committing the whole window's state instead changes them). A
  draft model with such layers is refused in one line."""
  cfg = load_config("tiny-qwen3.5", ["model.max_seq_len=64", "data.seq_len=32"]).model
  runtime = Runtime(cfg, MeshConfig(fsdp=1), jax.devices()[:1], seed=0)
  params, model_state = runtime.init()

  def engine(**options):
    return Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=3, page_size=8,
                  prefill_chunks=(8,), **options)
  prompts, settings = [[1, 2, 3], list(range(40, 60)), [7] * 9], SamplingParams(max_tokens=30, stop_token_ids=())
  plain = engine()
  want = [r.tokens for r in plain.generate(prompts, settings)]
  drafted = engine(speculative=_EveryThirdWrong({tuple(p): w for p, w in zip(prompts, want)}))
  assert [r.tokens for r in drafted.generate(prompts, settings)] == want
  proposed, accepted = (drafted.stats[f"speculative_{x}"] for x in ("proposed", "accepted"))
  assert 0 < accepted < proposed and drafted.stats["speculative_rounds"] < 3 * 30
  with pytest.raises(ConfigError, match="draft has linear-attention layers"):
    _engine(512, 0, draft=DraftModel(plain, k=2))


def test_rows_with_and_without_speculation_share_the_rounds(plain):
  """A request that turns speculation off (`SamplingParams.speculative=False`) shares the rounds
  of those that keep it on: the same tokens, no proposals for it, one token per target pass."""
  target = _engine(512, 0, draft=DraftModel(_engine(512, 0), k=3))  # its own draft: every proposal kept
  mixed = [SamplingParams(max_tokens=15, stop_token_ids=(), speculative=on) for on in (True, False, True)]
  done = target.generate(PROMPTS, mixed)
  assert [r.tokens for r in done] == plain
  assert done[1].draft_proposed == 0 and done[0].draft_accepted == done[0].draft_proposed > 0
  # The off row took 15 passes; the draft's rows fewer (at least 4), then left the rounds.
  assert 4 + 15 + 4 <= target.stats["speculative_rounds"] < 3 * 15


@pytest.mark.parametrize("source", ["ngram", "draft"])
def test_a_row_at_the_end_of_the_context_with_no_one_to_preempt(source):
  """One slot, pools of exactly one context's pages, and a completion that runs to the last
  position: a round asks pages only for the positions the context has (k more past its end
  are written nowhere), and the tokens are the plain engine's."""
  prompt, settings = [7] * 50, SamplingParams(max_tokens=14, stop_token_ids=())
  want = _engine(512, 0, slots=1, num_pages=8).generate([prompt], settings)[0].tokens
  draft = NgramDraft(k=3) if source == "ngram" else DraftModel(_engine(512, 0, slots=1, num_pages=8), k=3)
  got = _engine(512, 0, slots=1, num_pages=8, draft=draft).generate([prompt], settings)[0]
  assert got.tokens == want and len(want) == 14 and got.draft_proposed > 0


def test_speculative_rounds_join_continuous_batching(plain):
  """Requests that arrive while others decode, and a pool so small that rows are preempted
  and recomputed, still get exactly the target's greedy tokens."""
  draft = _engine(512, 1, num_layers=1)
  target = _engine(512, 0, slots=3, num_pages=9, draft=DraftModel(draft, k=3))
  first = target.submit(PROMPTS[0], GREEDY_15)
  for _ in range(2):
    target.step()
  later = [target.submit(p, GREEDY_15) for p in PROMPTS[1:]]
  while target.has_work:
    target.step()
  assert [r.completion().tokens for r in (first, *later)] == plain
  assert target.stats["preemptions"] > 0
  assert draft.pool.free == draft.pool.num_pages


def test_the_speculative_flag_reads_its_source_and_serve_default():
  from jaxpar.inference.commands import speculative_options
  assert speculative_options("ngram,k=5,default=off") == {"ngram": True, "k": 5, "n": 3, "default": False}
  assert speculative_options("draft=runs/small") == {"draft": "runs/small", "k": 4, "default": True}
  with pytest.raises(ConfigError, match="default=on\\|off"):
    speculative_options("ngram,default=maybe")


class _ShiftedBytes(ByteTokenizer):
  def encode(self, text, *args, **kwargs):
    return [t + 1 for t in super().encode(text, *args, **kwargs)]


def test_speculative_refuses_what_it_cannot_do():
  with pytest.raises(ConfigError, match="min_n <= max_n"):
    NgramDraft(k=3, max_n=2, min_n=3)
  with pytest.raises(ConfigError, match="at least one token"):
    NgramDraft(k=0)
  with pytest.raises(ConfigError, match="share a vocabulary"):
    _engine(512, 0, draft=DraftModel(_engine(256, 1), k=2))
  other = _engine(512, 1, num_layers=1)
  other.tokenizer = _ShiftedBytes()  # the same vocabulary size, other ids for the same text
  with pytest.raises(ConfigError, match="tokenizer differs"):
    _engine(512, 0, draft=DraftModel(other, k=2))
  target = _engine(512, 0, draft=DraftModel(_engine(512, 1, num_layers=1), k=2))
  with pytest.raises(UserError, match="reports no log-probabilities"):
    target.submit([1, 2], SamplingParams(max_tokens=3, logprobs=True))


@pytest.mark.slow
@pytest.mark.parametrize("source", ["draft", "ngram", "medusa", "medusa tree", "mtp"])
def test_sampled_speculative_matches_the_target_distribution(source):
  """Medusa: random heads over the target (their proposals come out of its own pass), on its
  output projection (`shared_projection`), as a chain or a tree."""
  vocab = 16
  draft = {"draft": lambda: DraftModel(_engine(vocab, 5, num_layers=1), k=2),
           "ngram": lambda: NgramDraft(k=2, max_n=2), "medusa": lambda: MedusaDraft(k=2),
           "medusa tree": lambda: MedusaDraft(tree=5), "mtp": lambda: MtpDraft(k=2)}[source]()
  heads = {"medusa": {"heads": 2, "shared_projection": True}} if source.startswith("medusa") else {}
  target = _mtp_engine(vocab, draft) if source == "mtp" else _engine(vocab, 0, draft=draft, **heads)
  prompt = [3, 1, 4] if source == "draft" else [3, 1, 4, 3, 1]  # "3 1" occurred: lookup proposes "4 3"
  # Heads (and the MTP module) propose from the second round on, and a round proposes only
  # what max_tokens leaves room for: a third token gives the second its proposal.
  tokens = 3 if source.startswith("medusa") or source == "mtp" else 2
  draws = []
  for start in range(0, 640, 8):
    results = target.generate([prompt] * 8, [SamplingParams(max_tokens=tokens, temperature=1.0, seed=start + i,
                                                            stop_token_ids=()) for i in range(8)])
    draws += [r.tokens for r in results]
  draws = np.asarray(draws)
  # Exact target distributions: p(t1 | prompt) and the marginal of t2.
  logits_of = jax.jit(lambda tokens: target.runtime.merge(target.params, target.model_state)(tokens)[0][:, -1])
  p1 = np.asarray(jax.nn.softmax(logits_of(jnp.asarray([prompt])))[0], np.float64)
  p2_given = np.asarray(jax.nn.softmax(logits_of(jnp.asarray([prompt + [t] for t in range(vocab)]))), np.float64)
  for column, probs in ((0, p1), (1, p1 @ p2_given)):
    statistic, df = _chi2(np.bincount(draws[:, column], minlength=vocab), probs / probs.sum())
    assert statistic < CHI2_999[df], (column, statistic)
  assert 0 < target.stats["speculative_accepted"] < target.stats["speculative_proposed"]
