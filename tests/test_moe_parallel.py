"""Expert parallelism on 8 simulated devices equals one device: a DeepSeek-style MoE model
(a dense first layer, a shared expert, sigmoid routing with the auxiliary-loss-free bias,
both router losses) with GPT-OSS's pieces too (q/k/v/o biases, sinks, a learned router
bias, biased experts with the clamped SwiGLU) gives the same loss, gradients, auxiliary
losses and updated router bias with expert=2, 4, 8, expert=2 x fsdp=2 x tensor=2 and
expert=2 x context=2 x fsdp=2 as with expert=1, in f32, and
the compiled step exchanges tokens with all-to-all exactly when experts are split."""

import jax
import numpy as np
import pytest

from jaxpar.config import from_dict
from jaxpar.objectives.lm import lm_loss
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import SMALL_MODEL, synthetic_batch

MOE_MODEL = {**SMALL_MODEL, "family": "deepseek", "num_layers": 2, "first_dense_layers": 1,
             "attention_bias": True, "attention_out_bias": True, "attention_sinks": True,
             "moe": {"num_experts": 8, "experts_per_token": 2, "expert_mlp_dim": 32, "shared_mlp_dim": 32,
                     "router": "sigmoid", "routed_scale": 2.0, "bias_update_rate": 0.01,
                     "balance_loss": 0.01, "router_z_loss": 0.001, "router_bias": True, "expert_bias": True,
                     "activation": "clamped_swiglu", "swiglu_limit": 0.5}}
MESHES = {
  "fsdp8": {"fsdp": 8},
  "ep2_fsdp4": {"expert": 2, "fsdp": 4},
  "ep4_fsdp2": {"expert": 4, "fsdp": 2},
  "ep8": {"expert": 8, "fsdp": 1},
  "ep2_fsdp2_tp2": {"expert": 2, "fsdp": 2, "tensor": 2},
  # Context parallelism splits the sequences: the dispatch's devices along `context` hold
  # other tokens, whatever the weights are split over.
  "ep2_context2_fsdp2": {"expert": 2, "context": 2, "fsdp": 2},
}


def _config(mesh):
  return from_dict({"model": MOE_MODEL, "mesh": {"fsdp": 1, **mesh},
                    "data": {"seq_len": 32, "global_batch_size": 8},
                    "train": {"steps": 1, "log_every": 0}, "checkpoint": {"enabled": False}})


def _one_gradient_step(config, devices=None):
  """(HLO text, numpy grads, sums and new model state) of one compiled gradient step."""
  trainer = Trainer(config, devices)
  params, model_state = trainer.runtime.init()
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in synthetic_batch(config).items()}
  gradients = jax.jit(make_gradients(lm_loss(trainer.graphdef, z_loss=0.0), microbatches=1))
  with trainer.context():
    compiled = gradients.lower(params, batch, model_state).compile()
  grads, sums, model_state = jax.device_get(compiled(params, batch, model_state))
  return compiled.as_text(), grads, sums, model_state


@pytest.fixture(scope="module")
def reference():
  return _one_gradient_step(_config({}), jax.devices()[:1])


@pytest.fixture(scope="module", params=sorted(MESHES))
def sharded(request):
  return request.param, _one_gradient_step(_config(MESHES[request.param]))


def test_expert_parallel_step_equals_one_device(sharded, reference):
  name, (hlo, grads, sums, model_state) = sharded
  _, want_grads, want_sums, want_state = reference
  assert set(sums) == set(want_sums) >= {"loss/moe_balance", "loss/moe_router_z", "metric/moe/load"}
  for key, want in want_sums.items():
    np.testing.assert_allclose(sums[key], want, rtol=1e-5, atol=1e-6, err_msg=f"{name}: {key}")
  layer = want_grads["layers"]
  for got_by in (layer["attn"]["o_bias"], layer["attn"]["sinks"],
                 *(layer["mlp"][n] for n in ("router_bias", "gate_bias", "up_bias", "down_bias"))):
    assert np.abs(got_by).max() > 0  # GPT-OSS's parameters take part
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max(),
                               err_msg=f"{name}: {jax.tree_util.keystr(path)}")
  # The bias moved (its update is a sign step) and moved identically.
  bias, want_bias = model_state["layers"]["mlp"]["bias"], want_state["layers"]["mlp"]["bias"]
  assert np.abs(want_bias).max() > 0
  np.testing.assert_array_equal(bias, want_bias)


def test_tokens_cross_devices_by_all_to_all_only_under_expert_parallelism(sharded):
  name, (hlo, *_) = sharded
  # The dispatch's own, in its shard_map (the embedding's scatter-add gradient may use one too).
  exchanges = sum(" all-to-all(" in line and "shard_map/all_to_all" in line for line in hlo.splitlines())
  if name == "fsdp8":
    assert exchanges == 0
  else:
    # Forward: tokens, their expert ids, results; backward: the two float exchanges again.
    assert exchanges >= 5, (name, exchanges)
