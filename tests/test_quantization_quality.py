"""Quality on a trained model: the embedded default (`tiny`), trained briefly on the bundled
corpus minus its last two chapters, evaluated on those with float32 weights, int8 / int4 /
W8A8 weights, and int8 / KIVI 4-bit / 2-bit KV caches (in a full forward that attends as
each decode step would read the quantized cache).

The issue's bar: int8 within 1% of the float perplexity. The other bounds are stated here
from measurements (see README), with room for run-to-run change; the measured values sit
at half of them or less.
"""

import jax
import numpy as np
import pytest

from jaxpar.config import load_config, replace
from jaxpar.data.sources import read_documents
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.data.heldout import split_heldout, token_windows
from jaxpar.models.kv_quant import KVQuantization
from jaxpar.convert.quantize import quantization_section
from jaxpar.weights import quantize_params
from jaxpar.runtime import Runtime
from jaxpar.train.evaluator import perplexity
from jaxpar.train.trainer import Trainer

pytestmark = [pytest.mark.optimized, pytest.mark.long]  # it trains tiny for 100 steps first

STEPS, HELDOUT_DOCUMENTS, WINDOWS = 100, 2, 16  # the last two chapters: ~24k bytes
WEIGHT_MODES = {"int8": (None, 0.01), "w8a8": (None, 0.02), "int4": (32, 0.04)}  # group, ppl bound
KV_MODES = {"int8": 0.005, "int4": 0.01, "int2": 0.03}
LOGITS_ERROR = {"int8": 0.03, "w8a8": 0.08, "int4": 0.3}  # max |dlogit| / max |logit|


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  train_docs, heldout = split_heldout(read_documents("bundled"), HELDOUT_DOCUMENTS)
  source = tmp_path_factory.mktemp("corpus") / "train.txt"
  source.write_text("\f".join(train_docs))
  config = load_config("tiny", [f"data.source={source}", f"train.steps={STEPS}", "mesh.fsdp=1",
                                "data.global_batch_size=16", "checkpoint.enabled=false",
                                "train.log_every=0"])
  trainer = Trainer(config, devices=jax.devices()[:1])
  params = trainer.fit(show_progress=False).state.params
  windows = token_windows(heldout, ByteTokenizer(), config.data.seq_len, WINDOWS)
  logits = _logits(trainer.runtime, params, windows[:4, :-1])
  return config, trainer.runtime, params, windows, perplexity(trainer.runtime, params, windows), logits


def _logits(runtime, params, tokens):
  with runtime.context():
    return np.asarray(jax.jit(lambda p, t: runtime.merge(p)(t)[0])(params, tokens))


def test_the_float_model_learned_something(trained):
  base = trained[4]
  assert base < 12.0  # uniform over 258 bytes would be 258


@pytest.mark.parametrize("mode", list(WEIGHT_MODES))
def test_quantized_weights_perplexity_and_logits(trained, mode):
  config, runtime, params, windows, base, want = trained
  group, bound = WEIGHT_MODES[mode]
  q_config = replace(config, model={"quantization": quantization_section(mode, group)})
  q_runtime = Runtime(q_config.model, q_config.mesh, jax.devices()[:1])
  q_params = quantize_params(params, q_runtime)
  delta = perplexity(q_runtime, q_params, windows) / base - 1
  assert abs(delta) < bound, f"{mode}: perplexity {delta:+.3%} vs float"
  got = _logits(q_runtime, q_params, windows[:4, :-1])
  error = float(np.abs(got - want).max() / np.abs(want).max())
  assert 0 < error < LOGITS_ERROR[mode], f"{mode}: logits error {error:.3%}"


@pytest.mark.parametrize("mode", list(KV_MODES))
def test_quantized_kv_cache_perplexity(trained, mode):
  _, runtime, params, windows, base, _ = trained
  spec = KVQuantization(mode, page_size=16, window=32)
  delta = perplexity(runtime, params, windows, kv_quantization=spec) / base - 1
  assert abs(delta) < KV_MODES[mode], f"kv {mode}: perplexity {delta:+.3%} vs float"


def test_int8_model_generates_through_the_engine_like_float(trained):
  """The quantized model runs in the inference engine unchanged; greedy continuations of
  held-out prompts agree with float32's (measured: all 4 x 32 tokens; the floor leaves room
  for one late divergence, which takes the rest of its row with it)."""
  from jaxpar.inference import Engine, SamplingParams
  config, runtime, params, windows, *_ = trained
  q_config = replace(config, model={"quantization": quantization_section("int8")})
  q_runtime = Runtime(q_config.model, q_config.mesh, jax.devices()[:1])
  prompts = [w[:64].tolist() for w in windows[:4]]
  outputs = []
  for rt, p in ((runtime, params), (q_runtime, quantize_params(params, q_runtime))):
    engine = Engine(rt, p, ByteTokenizer(), slots=4, max_seq_len=104, prefill_chunks=(64,))
    done = engine.generate(prompts, SamplingParams(max_tokens=32, stop_token_ids=()))
    outputs.append(np.array([c.tokens for c in done]))
  assert outputs[0].shape == (4, 32)
  assert (outputs[0][:, 0] == outputs[1][:, 0]).all()
  assert (outputs[0] == outputs[1]).mean() > 0.9


def test_quantized_kv_cache_in_the_engine(trained):
  """The engine stores its paged cache quantized (--kv-cache): pages shrink as the format
  says, nothing leaks, and greedy continuations stay close to the float cache's."""
  from jaxpar.inference import Engine, SamplingParams
  from jaxpar.models.kv_quant import nbytes
  _, runtime, params, windows, *_ = trained
  prompts = [w[:64].tolist() for w in windows[:4]]

  def run(kv_cache):
    engine = Engine(runtime, params, ByteTokenizer(), slots=4, max_seq_len=112, page_size=16,
                    prefill_chunks=(32,), kv_cache=kv_cache)
    done = engine.generate(prompts, SamplingParams(max_tokens=32, stop_token_ids=()))
    assert engine.pool.free == engine.pool.num_pages
    pool = {name: {k: v for k, v in group.items() if not k.startswith("tail")}
            for name, group in engine.cache.items()}
    return np.array([c.tokens for c in done]), nbytes(pool)
  float_tokens, float_bytes = run(None)
  # f32 pages vs int8 (+ a bf16 scale per token) / KIVI int4, int2 (+ per-channel and per-token scales).
  # Measured (bytes ratio, agreement of 4 x 32 greedy tokens): int8 (0.27, 1.0), int4 (0.17, 0.99),
  # int2 (0.11, 0.74); the floors leave room for one late divergence.
  bounds = {"int8": (0.30, 0.9), "int4": (0.22, 0.9), "int2": (0.16, 0.6)}  # (bytes ratio, agreement)
  for mode, (ratio, agreement) in bounds.items():
    tokens, pool_bytes = run(mode)
    assert pool_bytes / float_bytes < ratio, (mode, pool_bytes / float_bytes)
    assert (tokens == float_tokens).mean() > agreement, (mode, (tokens == float_tokens).mean())
