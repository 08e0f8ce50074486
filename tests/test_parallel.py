"""DP, FSDP, TP and their mixes on 8 simulated devices match the 1-device run, hold
1/N of the state per device, and compile to the collectives the strategy implies."""

import re

import jax
import numpy as np
import pytest

from jaxpar.objectives.lm import lm_loss
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config, synthetic_batch

STRATEGIES = {
  # name: (mesh sizes, rules, how many ways the model state is split)
  "dp8": ({"data": 8, "fsdp": 1}, "dp", 1),
  "fsdp8": ({"fsdp": 8}, "fsdp", 8),
  "tp2_fsdp4": ({"fsdp": 4, "tensor": 2}, "fsdp_tp", 8),
  "dp2_fsdp2_tp2": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", 4),
}


def _run_one_step(trainer, batch):
  """Initial params, grads, loss and updated params of one step, as numpy."""
  state = trainer.init_state()
  initial = jax.device_get(state.params)
  gradients = jax.jit(make_gradients(lm_loss(trainer.graphdef, z_loss=0.0), microbatches=1))
  global_batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
  with trainer.context():
    grads, aux, _ = gradients(state.params, global_batch)
  new_state, metrics = trainer.step(state, global_batch)
  return {"initial": initial, "grads": jax.device_get(grads), "loss": float(metrics["loss"]),
          "params": jax.device_get(new_state.params), "state": new_state}


@pytest.fixture(scope="module")
def reference():
  config = small_config(mesh={"fsdp": 1})
  return _run_one_step(Trainer(config, devices=jax.devices()[:1]), synthetic_batch(config))


@pytest.fixture(scope="module", params=sorted(STRATEGIES))
def strategy(request):
  sizes, rules, shards = STRATEGIES[request.param]
  config = small_config(mesh={**sizes, "rules": rules})
  trainer = Trainer(config)
  return request.param, trainer, shards, _run_one_step(trainer, synthetic_batch(config))


def _assert_trees_close(actual, expected, rtol, atol):
  """`atol` is relative to each leaf's largest value: f32 sums in another order differ
  by a few ulps of the largest term, whatever the leaf's scale."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * np.abs(b).max(),
                               err_msg=jax.tree_util.keystr(path))


def test_same_initial_params_loss_grads_and_update(strategy, reference):
  _, _, _, run = strategy
  _assert_trees_close(run["initial"], reference["initial"], rtol=0, atol=0)
  assert run["loss"] == pytest.approx(reference["loss"], rel=1e-5)
  _assert_trees_close(run["grads"], reference["grads"], rtol=1e-4, atol=1e-5)
  _assert_trees_close(run["params"], reference["params"], rtol=1e-5, atol=1e-5)


def _bytes_on_device(tree, device):
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
             for shard in leaf.addressable_shards if shard.device == device)


def test_state_bytes_per_device_are_total_over_shards(strategy):
  name, trainer, shards, run = strategy
  state = {"params": run["state"].params, "opt_state": run["state"].opt_state}
  total = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
  for device in trainer.mesh.devices.flat:
    per_device = _bytes_on_device(state, device)
    # Norm scales and scalars stay replicated: a few percent at this tiny size.
    assert per_device == pytest.approx(total / shards, rel=0.05), name


def _collectives(trainer, batch):
  abstract_batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
                    for k, v in batch.items()}
  state = trainer.abstract_state()
  with trainer.context():
    hlo = trainer.train_step.lower(state, abstract_batch).compile().as_text()
  found = {}
  for shape, kind in re.findall(r"= (.+?) (all-gather|reduce-scatter|all-reduce|all-to-all|"
                                r"collective-permute)(?:-start)?\(", hlo):
    found.setdefault(kind, []).append(shape)
  return found


def test_collectives_match_strategy(strategy):
  name, trainer, _, _ = strategy
  found = _collectives(trainer, synthetic_batch(trainer.config))
  # Point-to-point permutes of activations or weights appear when XLA must reshard an array
  # it could not partition in place (it did for the embedding lookup before the table was
  # pinned to vocab only). Token ids may move: the embedding gradient's scatter needs them.
  assert all(shape.startswith(("s32", "(s32")) for shape in found.get("collective-permute", [])), found
  if name == "dp8":
    assert "all-reduce" in found and "all-gather" not in found and "reduce-scatter" not in found
  if name == "fsdp8":
    assert "all-gather" in found and ("reduce-scatter" in found or "all-reduce" in found)
  if "tp2" in name:
    assert "all-reduce" in found
    # The vocab-split embedding [512, 64] is never gathered whole.
    assert not any(re.match(r"f32\[512,64\]", shape) for shape in found.get("all-gather", [])), found
