"""Attention sinks in the model (`model.attention_sinks`, GPT-OSS's attention): a `sinks`
parameter [heads] reaching every KV-cache kind. The engine's paged decode (float and int8
pages) past a window equals a full forward's greedy choice. (A train step on 8 devices
equal to one device's, the sinks' gradient included: tests/test_gemma.py.)"""

import jax
import numpy as np
import pytest

from jaxpar.config import MeshConfig, ModelConfig
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams
from jaxpar.models.kv_quant import KVQuantization
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL

WINDOW, PAGE, LENGTH = 8, 4, 64
MODEL = ModelConfig(**{**SMALL_MODEL, "max_seq_len": LENGTH, "attention_sinks": True,
                       "layer_pattern": [{"sliding_window": WINDOW}, {}]})


@pytest.fixture(scope="module")
def run():
  runtime = Runtime(MODEL, MeshConfig(fsdp=1), jax.devices()[:1])
  params, model_state = runtime.init()
  # Sinks start at 0; give each head its own, some large enough to take most of the weight.
  sinks = params["layers"]["attn"]["sinks"]
  assert sinks.shape == (MODEL.num_layers, MODEL.num_heads)
  params["layers"]["attn"]["sinks"] = jax.numpy.asarray([[2.0, -1.0, 0.5, 4.0], [-2.0, 1.0, 3.0, 0.0]])
  return runtime, params, model_state


def _logits(runtime, params, tokens, kv_quantization=None):
  with runtime.context():
    return np.asarray(jax.jit(lambda p, t: runtime.merge(p)(t, kv_quantization=kv_quantization)[0])(params, tokens))


def test_sinks_change_the_model(run):
  runtime, params, _ = run
  no_sinks = jax.device_get(params)
  no_sinks["layers"]["attn"]["sinks"] = np.full_like(no_sinks["layers"]["attn"]["sinks"], -1e9)
  tokens = np.arange(32, dtype=np.int32)[None]
  assert np.abs(_logits(runtime, params, tokens) - _logits(runtime, no_sinks, tokens)).max() > 1e-3


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_engine_decodes_past_the_window_like_a_full_forward(run, kv_cache):
  runtime, params, model_state = run
  engine = Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=2, page_size=PAGE,
                  prefill_chunks=(8,), kv_cache=kv_cache)
  prompts = [np.random.default_rng(1).integers(0, 256, n).tolist() for n in (5, 13)]
  requests = engine.generate(prompts, SamplingParams(max_tokens=40, stop_token_ids=()))
  spec = None if kv_cache is None else KVQuantization(kv_cache, PAGE, 0)  # as the engine stores it
  for prompt, request in zip(prompts, requests):
    sequence = np.zeros((1, LENGTH), np.int32)
    sequence[0, :len(prompt) + len(request.tokens)] = prompt + request.tokens
    logits = _logits(runtime, params, sequence, spec)[0]
    assert len(request.tokens) == 40
    assert np.argmax(logits[len(prompt) - 1:len(prompt) + 39], axis=-1).tolist() == request.tokens
