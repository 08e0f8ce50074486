"""tiny-moe trains end to end with expert parallelism (expert=4 x fsdp=2 on 8 simulated
devices): the loss falls on the bundled corpus, the load-balancing loss lowers the experts'
max/mean load imbalance against the same run without it, per-expert metrics reach
metrics.jsonl, TensorBoard and the summary, and routing changes never recompile the step."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.inference import Engine, SamplingParams
from jaxpar.train.trainer import Trainer
from tests.helpers import counting_compiles, tensorboard_scalars

STEPS = 30
SHORT = [f"train.steps={STEPS}", "train.warmup_steps=5", "train.log_every=0", "data.global_batch_size=16",
         "data.seq_len=64", "model.num_layers=2", "model.scan_unroll=1", "mesh.expert=4", "mesh.fsdp=2",
         "checkpoint.enabled=false", "train.peak_flops_per_device=1e12"]
VARIANTS = {"unbalanced": ["model.moe.balance_loss=0", "model.moe.router_z_loss=0"],
            "balanced": []}  # tiny-moe's own: balance_loss 0.01, router_z_loss 0.001

pytestmark = pytest.mark.optimized  # they train until the model learns


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  results = {}
  for name, overrides in VARIANTS.items():
    run_dir = tmp_path_factory.mktemp(name)
    trainer = Trainer(load_config("tiny-moe", SHORT + overrides + [f"train.run_dir={run_dir}"]))
    batches = trainer.batches()
    result = trainer.fit(batches=batches, show_progress=False)
    # More steps on new text: other routings, other per-device loads, the same program.
    state = result.state
    with counting_compiles() as compiles:
      for _ in range(3):
        state, metrics = trainer.step(state, next(batches))
      jax.block_until_ready(metrics)
    results[name] = (run_dir, result, compiles, trainer, state)
  return results


def _imbalance(result, last=10):
  return float(np.mean([h["moe/imbalance"] for h in result.history[-last:]]))


def test_tiny_moe_loss_falls_without_drops_or_recompiles(runs):
  for name, (_, result, recompiled, *_) in runs.items():
    losses = [h["loss"] for h in result.history]
    assert losses[0] > 5.0 and np.mean(losses[-5:]) < losses[0] - 2.0, (name, losses)
    assert all(h["moe/dropped"] == 0.0 for h in result.history)  # dropless
    assert recompiled == [], (name, recompiled)


def test_balance_loss_lowers_load_imbalance(runs):
  balanced, unbalanced = _imbalance(runs["balanced"][1]), _imbalance(runs["unbalanced"][1])
  assert balanced < 0.85 * unbalanced, (balanced, unbalanced)
  assert balanced < float(np.mean([h["moe/imbalance"] for h in runs["balanced"][1].history[:5]]))


def test_per_expert_metrics_reach_jsonl_tensorboard_and_summary(runs):
  run_dir, result, *_ = runs["balanced"]
  record = json.loads((Path(run_dir) / "metrics.jsonl").read_text().splitlines()[-1])
  load = [record[f"moe/load/{i}"] for i in range(8)]
  assert "moe/load/8" not in record and sum(load) == pytest.approx(1.0, abs=1e-5)
  # Layers' max/mean averaged: at least the max/mean of the layer-averaged load.
  assert record["moe/imbalance"] >= max(load) * 8 - 1e-5
  assert record["moe/dropped"] == 0.0 and record["loss/moe_balance"] > 0 and record["loss/moe_router_z"] > 0
  scalars = tensorboard_scalars(Path(run_dir))
  assert scalars["train/moe/imbalance"][STEPS] == pytest.approx(record["moe/imbalance"], rel=1e-6)
  assert result.summary["moe/imbalance"] == record["moe/imbalance"]


def test_trained_moe_generates_through_the_engine_as_recomputed(runs):
  # The trained model on its training mesh (expert 4 x fsdp 2): decode dispatches through EP
  # with a batch too small to split. Greedy tokens from the cache equal the full forward's
  # argmax at every position of prompt + completion (teacher-forced: the same as recomputing).
  *_, trainer, state = runs["balanced"]
  engine = Engine(trainer.runtime, state.params, trainer.tokenizer(), model_state=state.model_state,
                  slots=2, max_seq_len=64, page_size=8, prefill_chunks=(8, 32))
  prompts = ["It is a truth universally", "Elizabeth"]
  done = engine.generate(prompts, SamplingParams(max_tokens=12, stop_token_ids=()))
  # One compiled forward: each sequence padded after its end, which causal attention and
  # dropless per-token routing never read from earlier positions.
  argmax = jax.jit(lambda params, model_state, tokens: trainer.runtime.merge(params, model_state)(tokens)[0][0].argmax(-1))
  with trainer.runtime.context():
    for prompt, completion in zip(prompts, done):
      tokens = engine.encode(prompt) + completion.tokens
      padded = np.zeros((1, 64), np.int32)
      padded[0, :len(tokens) - 1] = tokens[:-1]
      predicted = np.asarray(argmax(state.params, state.model_state, padded))[:len(tokens) - 1]
      assert predicted[-12:].tolist() == completion.tokens, prompt
