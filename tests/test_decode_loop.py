"""Generation runs the layer loop rolled whatever the training unroll (programs.py): an
engine on a model that unrolls its layers gives the same tokens and log-probs as one that
does not, through the rolled programs."""

import jax
import numpy as np

from jaxpar.config import MeshConfig, ModelConfig
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL


def test_an_unrolled_model_generates_through_the_rolled_loop_alike():
  completions = {}
  for unroll in (1, SMALL_MODEL["num_layers"]):
    runtime = Runtime(ModelConfig(**{**SMALL_MODEL, "max_seq_len": 64, "scan_unroll": unroll}), MeshConfig(fsdp=1),
                      jax.devices()[:1])
    params, model_state = runtime.init()  # the same seed: the same weights
    engine = Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=2, page_size=8,
                    prefill_chunks=(16,))
    assert (engine.programs.graphdef is runtime.graphdef) == (unroll == 1)
    completions[unroll] = engine.generate(["the quick brown fox", "a"], SamplingParams(max_tokens=8, logprobs=True,
                                                                                      stop_token_ids=()))
  rolled, unrolled = completions.values()
  assert [c.tokens for c in rolled] == [c.tokens for c in unrolled]
  np.testing.assert_allclose([c.logprobs for c in rolled], [c.logprobs for c in unrolled], atol=1e-5)
