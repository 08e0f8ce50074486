"""DeepSeek-V3's multi-token-prediction module as a speculative draft (jaxpar/inference/mtp.py):
over tiny-deepseek trained on the bundled corpus (MLA, routed experts, MTP depth 1), greedy
decoding gives exactly plain decoding's tokens, and the module's proposals are kept exactly
where a plain forward's MTP guesses over the same text say they should be."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.config import MeshConfig, load_config
from jaxpar.data import ByteTokenizer
from jaxpar.errors import ConfigError
from jaxpar.inference import Engine, SamplingParams
from jaxpar.inference.commands import speculative_options
from jaxpar.inference.mtp import MtpDraft
from jaxpar.runtime import Runtime
from jaxpar.train.trainer import Trainer

pytestmark = [pytest.mark.xdist_group("mtp_draft")]

PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy", "She was"]
MAX_TOKENS = 40
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=())
ENGINE = dict(slots=4, max_seq_len=128, page_size=8, prefill_chunks=(16,), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """tiny-deepseek with 2 layers, 60 steps on the bundled corpus (its MTP loss falls with the rest)."""
  root = tmp_path_factory.mktemp("mtp")
  config = load_config("tiny-deepseek", ["train.steps=60", "train.warmup_steps=5", "train.log_every=0",
                                         "data.global_batch_size=8", "data.seq_len=64", "model.num_layers=2",
                                         "model.max_seq_len=128", "model.scan_unroll=1", "train.sample_tokens=0",
                                         "eval.every_steps=0", f"train.run_dir={root}"])
  Trainer(config, jax.devices()[:1]).fit(show_progress=False)
  return root


def _rounds(guess, n):
  """(proposed, accepted) of k=1 greedy rounds over a sequence whose first n tokens are the
  prompt, from the module's guesses (guess[i]: its guess of t_{i+2}): a round at context length
  L checks guess[L - 2] against t_L when max_tokens leaves room for it; the first round after
  the prompt has no proposal."""
  proposed = accepted = 0
  length = n + 1
  while length < n + MAX_TOKENS:
    if length - n <= MAX_TOKENS - 2:
      proposed += 1
      if guess[length - 2] == guess.tokens[length]:
        accepted += 1
        length += 2
        continue
    length += 1
  return proposed, accepted


class _Guesses(np.ndarray):
  tokens: np.ndarray


@pytest.fixture(scope="module")
def plain(run):
  """(the engine without a draft, its greedy results for PROMPTS)."""
  engine = Engine.from_checkpoint(run, **ENGINE)
  return engine, engine.generate(PROMPTS, GREEDY)


def test_mtp_drafts_give_plain_tokens_and_are_kept_where_the_module_guesses_right(run, plain):
  plain_engine, plain = plain
  engine = Engine.from_checkpoint(run, **ENGINE, speculative=MtpDraft(k=1))
  done = engine.generate(PROMPTS, GREEDY)
  assert [r.tokens for r in done] == [r.tokens for r in plain]
  # Where the draft's proposals should be kept: a plain forward of each whole sequence.
  merge = plain_engine.runtime.merge
  forward = jax.jit(lambda tokens: merge(plain_engine.params, plain_engine.model_state).mtp_forward(tokens))
  want_proposed = want_accepted = 0
  for result in done:
    sequence = np.asarray(result.prompt_tokens + result.tokens)
    guess = np.asarray(jnp.argmax(forward(jnp.asarray(sequence)[None])[0], axis=-1)).view(_Guesses)
    guess.tokens = sequence
    proposed, accepted = _rounds(guess, len(result.prompt_tokens))
    assert (result.draft_proposed, result.draft_accepted) == (proposed, accepted)
    want_proposed, want_accepted = want_proposed + proposed, want_accepted + accepted
  assert 0 < engine.stats["speculative_accepted"] == want_accepted < want_proposed
  assert engine.stats["speculative_rounds"] == 3 * MAX_TOKENS - want_accepted

  chained = Engine.from_checkpoint(run, **ENGINE, speculative=MtpDraft(k=3))
  assert [r.tokens for r in chained.generate(PROMPTS, GREEDY)] == [r.tokens for r in plain]
  assert chained.stats["speculative_accepted"] >= want_accepted  # deeper guesses keep at least as many
  assert chained.pool.free == chained.pool.num_pages


def test_generate_drafts_with_the_module_from_the_command_line(run, plain, capsys):
  assert main(["generate", str(run), "--prompt", PROMPTS[1], "--max-tokens", str(MAX_TOKENS), "--temperature", "0",
               "--speculative", "mtp,k=2", "--slots", "1", "--max-seq-len", "128"]) == 0
  assert ByteTokenizer().decode(plain[1][1].tokens) in capsys.readouterr().out


def test_mtp_over_a_quantized_cache_and_what_it_refuses():
  """A gqa DeepSeek-style model (MLA's latent cache is not quantized) over an int8 cache: plain
  int8 decoding's tokens, with the module's own cache in float; a model without the module,
  and k out of range, refused in one line."""
  cfg = load_config("tiny-deepseek", ["model.attention_block=gqa", "model.num_layers=2", "model.max_seq_len=64",
                                      "data.seq_len=32", "model.vocab_size=32"]).model
  runtime = Runtime(cfg, MeshConfig(fsdp=1), jax.devices()[:1], seed=0)
  params, state = runtime.init()

  def engine(**options):
    return Engine(runtime, params, ByteTokenizer(), model_state=state, slots=3, page_size=8, prefill_chunks=(8,),
                  kv_cache="int8", **options)
  prompts, settings = [[1, 2, 3], list(range(10, 30)), [7] * 9], SamplingParams(max_tokens=30, stop_token_ids=())
  want = [r.tokens for r in engine().generate(prompts, settings)]
  drafted = engine(speculative=MtpDraft(k=2))
  assert [r.tokens for r in drafted.generate(prompts, settings)] == want
  assert drafted.stats["speculative_accepted"] > 0  # 32 tokens: random guesses are kept now and then
  assert drafted.cache["mtp"]["k"].dtype == jnp.float32

  plain = load_config("tiny").model.model_copy(update={"max_seq_len": 64})
  other = Runtime(plain, MeshConfig(fsdp=1), jax.devices()[:1])
  with pytest.raises(ConfigError, match="no multi-token-prediction module"):
    Engine(other, other.init()[0], ByteTokenizer(), slots=1, speculative=MtpDraft())
  with pytest.raises(ConfigError, match="k=64: more proposals than the context"):
    engine(speculative=MtpDraft(k=64))
  assert speculative_options("mtp") == {"mtp": True, "k": 1, "default": True}
  assert speculative_options("mtp,k=2,default=off") == {"mtp": True, "k": 2, "default": False}
