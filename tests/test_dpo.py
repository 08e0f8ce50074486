"""DPO: the loss by hand on a toy pair, beta -> 0 as documented, and a margin that rises."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import small_config
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.errors import ConfigError
from jaxpar.data.preference_batches import pair_rows
from jaxpar.objectives import BASE
from jaxpar.objectives.dpo import REFERENCE, make_dpo_objective
from jaxpar.train.trainer import Trainer
from jaxpar.weights import join, read_network

LORA = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "down"]}


def _pairs(path, count=32):
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for _ in range(count):
      a, b = rng.integers(0, 10, 2)
      f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{(a + b + 3) % 19}"}) + "\n")
  return str(path)


def _config(tmp_path, model=None, run=None, objective=None, **train):
  return small_config(mesh={"fsdp": 1}, model={"lora": LORA} if model is None else model, tmp_path=run,
                      data={"source": _pairs(tmp_path / "pairs.jsonl"), "format": "preference", "seq_len": 16,
                            "global_batch_size": 8},
                      train={"objective": "dpo", "steps": 12, "learning_rate": 2e-2, "warmup_steps": 1, **train},
                      objective={"beta": 0.5, **(objective or {})})


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  """A LoRA model with random (nonzero) adapters and one pair."""
  trainer = Trainer(_config(tmp_path_factory.mktemp("dpo")), devices=jax.devices()[:1])
  state = trainer.init_state()
  keys = iter(jax.random.split(jax.random.key(0), 100))
  adapters = jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape), state.params)
  batch = pair_rows({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, None, ByteTokenizer(), 16)
  return trainer, adapters, state.frozen, state.model_state, batch


def _answer_logprob(logits, batch, row):
  logits = np.asarray(logits, np.float64)[row]
  log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  picked = log_probs[np.arange(len(batch["targets"][row])), batch["targets"][row]]
  return float((picked * batch["loss_mask"][row]).sum())


def test_loss_matches_hand_computation(toy):
  trainer, adapters, frozen, model_state, batch = toy
  beta = 0.5
  with trainer.context():
    total, (sums, _) = jax.jit(make_dpo_objective(trainer.graphdef, beta))(adapters, model_state, batch, frozen)
    model = lambda a: trainer.runtime.merge(join(a, frozen[BASE]), model_state)  # noqa: E731
    policy_logits = model(adapters)(batch["inputs"], batch["positions"], batch["segment_ids"])[0]
    zeros = jax.tree.map(jnp.zeros_like, adapters)
    reference_logits = model(zeros)(batch["inputs"], batch["positions"], batch["segment_ids"])[0]
  pc, pr = (_answer_logprob(policy_logits, batch, r) for r in (0, 1))
  rc, rr = (_answer_logprob(reference_logits, batch, r) for r in (0, 1))
  margin = beta * ((pc - rc) - (pr - rr))
  assert abs(margin) > 1e-2  # the adapters move the policy off the reference
  np.testing.assert_allclose(float(total), math.log1p(math.exp(-margin)), rtol=1e-5)
  np.testing.assert_allclose(float(sums["metric/reward_margin"]), margin, rtol=1e-5)
  assert float(sums["metric/reward_accuracy"]) == float(margin > 0) and float(sums["tokens"]) == 1.0
  assert batch["loss_mask"][0].sum() == 2  # "4" and eos: the prompt carries no weight


def test_small_beta_gives_ln2_and_a_gradient_proportional_to_beta(toy):
  trainer, adapters, frozen, model_state, batch = toy
  def loss_and_grad_norm(beta):  # beta traced: one compile for both
    objective = make_dpo_objective(trainer.graphdef, beta)
    (loss, _), g = jax.value_and_grad(objective, has_aux=True)(adapters, model_state, batch, frozen)
    return loss, jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
  with trainer.context():
    step = jax.jit(loss_and_grad_norm)
    losses, grads = zip(*[[float(v) for v in step(jnp.float32(beta))] for beta in (1e-4, 2e-4)])
  np.testing.assert_allclose(losses, math.log(2), atol=1e-4)
  np.testing.assert_allclose(grads[1] / grads[0], 2.0, rtol=1e-3)


def test_margin_rises_on_a_tiny_preference_set(tmp_path):
  trainer = Trainer(_config(tmp_path), devices=jax.devices()[:1])
  history = trainer.fit(show_progress=False).history
  margins = [h["reward_margin"] for h in history]
  assert margins[0] == 0.0  # new adapters: the policy is the reference
  assert np.mean(margins[-3:]) > 0.5 and np.mean([h["reward_accuracy"] for h in history[-3:]]) > 0.8
  assert history[-1]["loss"] < 0.5 * math.log(2)


def test_full_model_dpo_against_a_frozen_copy(tmp_path):
  """Without adapters the reference is a frozen copy of the starting weights (the seeded
  init here): the loss matches a hand computation, the margin rises, only the policy moves."""
  trainer = Trainer(_config(tmp_path, model={}, run=tmp_path, learning_rate=3e-3), devices=jax.devices()[:1])
  state = trainer.init_state()
  reference = state.frozen[REFERENCE]
  keys = iter(jax.random.split(jax.random.key(0), 100))
  policy = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), state.params)
  batch = pair_rows({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, None, ByteTokenizer(), 16)
  with trainer.context():
    total, (sums, _) = jax.jit(make_dpo_objective(trainer.graphdef, 0.5))(policy, state.model_state, batch,
                                                                           state.frozen)
    forward = jax.jit(lambda w: trainer.runtime.merge(w, state.model_state)(
        batch["inputs"], batch["positions"], batch["segment_ids"])[0])
    logits = [forward(w) for w in (policy, reference)]
  (pc, pr), (rc, rr) = ([_answer_logprob(x, batch, r) for r in (0, 1)] for x in logits)
  margin = 0.5 * ((pc - rc) - (pr - rr))
  assert abs(margin) > 1e-2
  np.testing.assert_allclose(float(total), math.log1p(math.exp(-margin)), rtol=1e-5)
  np.testing.assert_allclose(float(sums["metric/reward_margin"]), margin, rtol=1e-5)
  before = jax.device_get(reference)
  result = trainer.fit(state=state, show_progress=False)
  margins = [h["reward_margin"] for h in result.history]
  # Step 1's policy is the reference: margin 0 up to float rounding (the reference's forward,
  # outside the gradient, may fuse otherwise than the policy's).
  assert abs(margins[0]) < 1e-6 and np.mean(margins[-3:]) > 0.5
  leaves = lambda tree: jax.tree.leaves(jax.device_get(tree))  # noqa: E731
  assert all(np.array_equal(a, b) for a, b in zip(leaves(result.state.frozen[REFERENCE]), leaves(before)))
  assert any(not np.array_equal(a, b) for a, b in zip(leaves(result.state.params), leaves(before)))
  assert result.state.weights() is result.state.params  # the reference is not part of the model
  # objective.reference names a checkpoint instead (here the trained policy's).
  read = read_network(trainer.runtime, result.summary["checkpoint"], "objective.reference")
  assert all(np.array_equal(a, b) for a, b in zip(leaves(read), leaves(result.state.params)))


def test_dpo_config_errors(tmp_path):
  config = _config(tmp_path)
  with pytest.raises(ConfigError, match="drop objective.reference"):
    Trainer(small_config(model={"lora": LORA}, data=config.data.model_dump(), train=config.train.model_dump(),
                         objective={"reference": str(tmp_path)}))
  with pytest.raises(ConfigError, match="data.format=text"):
    Trainer(small_config(model={"lora": LORA}, train={"objective": "dpo"}))
