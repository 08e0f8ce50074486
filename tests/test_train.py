"""The training loop end to end: loss falls on real text, metrics are written, gradient
accumulation is exact, and the CLI runs the embedded default's path."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.objectives.lm import lm_loss
from jaxpar.train.metrics import StepClock
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config, synthetic_batch, tensorboard_scalars


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  run = tmp_path_factory.mktemp("train")
  config = small_config(data={"seq_len": 64, "global_batch_size": 16},
                        train={"steps": 40, "learning_rate": 3e-3, "warmup_steps": 5},
                        tmp_path=run)
  return config, Trainer(config).fit(show_progress=False)


def test_loss_falls_on_bundled_text(trained):
  _, result = trained
  losses = [h["loss"] for h in result.history]
  assert len(losses) == 40
  # Byte-level English: from ~ln(512) = 6.2 to well under 4 nats in 40 steps.
  assert losses[0] > 5.0 and np.mean(losses[-5:]) < 3.6, losses
  assert int(result.state.step) == 40


def test_metrics_jsonl_and_tensorboard_written(trained):
  config, result = trained
  run_dir = __import__("pathlib").Path(config.train.run_dir)
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 41))
  assert {"loss", "grad_norm", "lr", "step_time_s", "tokens_per_s", "mfu"} <= set(records[-1])
  scalars = tensorboard_scalars(run_dir)  # as TensorBoard reads them
  assert sorted(scalars["train/loss"]) == list(range(1, 41))
  assert scalars["train/loss"][40] == pytest.approx(records[-1]["loss"], rel=1e-6)
  assert 0 < result.summary["mfu"] < 1 and result.summary["tokens_per_s"] > 0


def test_gradient_accumulation_matches_full_batch():
  config = small_config()
  trainer = Trainer(config)
  state = trainer.init_state()
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in synthetic_batch(config).items()}
  results = []
  for microbatches in (1, 4):
    gradients = jax.jit(make_gradients(lm_loss(trainer.graphdef, z_loss=1e-4), microbatches=microbatches))
    with trainer.context():
      results.append(jax.device_get(gradients(state.params, batch)[:2]))
  (full, full_aux), (accumulated, accumulated_aux) = results
  assert accumulated_aux["tokens"] == full_aux["tokens"] == 8 * 31
  np.testing.assert_allclose(accumulated_aux["ce_sum"], full_aux["ce_sum"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(accumulated), jax.tree.leaves(full)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("mesh", [{"fsdp": 1}, {"fsdp": 4, "tensor": 2}])
def test_fused_chunked_loss_matches_plain_logits(mesh):
  config = small_config(mesh=mesh, model={"tie_embeddings": True})
  trainer = Trainer(config, devices=jax.devices()[:1] if mesh["fsdp"] == 1 else None)
  state = trainer.init_state()
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in synthetic_batch(config).items()}
  results = []
  for chunk in (0, 8):  # 32 positions in chunks of 8
    gradients = jax.jit(make_gradients(lm_loss(trainer.graphdef, z_loss=1e-3, logits_chunk_len=chunk), microbatches=1))
    with trainer.context():
      results.append(jax.device_get(gradients(state.params, batch)[:2]))
  (plain, plain_aux), (fused, fused_aux) = results
  for key in ("ce_sum", "z_sum", "tokens"):
    np.testing.assert_allclose(fused_aux[key], plain_aux[key], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_mesh_that_does_not_fit_devices_is_an_error():
  with pytest.raises(ValueError, match="needs 16 devices but 8 are available"):
    Trainer(small_config(mesh={"fsdp": 16}))
  with pytest.raises(ValueError, match="mesh.tensor=2 but mesh.rules='fsdp' never uses that axis"):
    Trainer(small_config(mesh={"fsdp": 4, "tensor": 2, "rules": "fsdp"}))


def test_tokenizer_larger_than_vocab_is_an_error():
  trainer = Trainer(small_config(model={"vocab_size": 128}, mesh={"fsdp": 1}), devices=jax.devices()[:1])
  with pytest.raises(ValueError, match="model.vocab_size=128 is smaller than the tokenizer's 258"):
    trainer.batches()


@pytest.mark.slow
def test_cli_train_runs_and_prints_a_sample(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "jaxpar", "train", "tiny", "train.steps=6", "train.log_every=3",
       f"train.run_dir={tmp_path}/run", "train.sample_tokens=8", "--no-progress"],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "done: loss" in result.stdout and "sample (temperature 0.8, top-p 0.95, seed 0):" in result.stdout
  assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_train_bad_mesh_exits_2_with_one_line(tmp_path):
  result = subprocess.run([sys.executable, "-m", "jaxpar", "train", "tiny", "mesh.fsdp=3",
                           f"train.run_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
  assert result.returncode == 2
  # The subprocess inherits the 8 simulated devices from conftest's XLA_FLAGS.
  assert "error: mesh fsdp=3 needs 3 devices but 8 are available" in result.stderr
  assert "Traceback" not in result.stderr


def test_step_times_are_the_gaps_between_completions_however_late_they_are_read():
  """The loop reads each step's metrics one step late; a step's time is still the gap between
  its completion and the previous one's (a fake clock stamps each completion)."""
  ticks = iter([1.0, 3.0, 4.5, 10.0, 10.5])
  clock = StepClock(clock=lambda: next(ticks))
  for step in (1, 2, 3):
    clock.watch(step, jax.numpy.ones(()))
  assert clock.step_time(1) is None  # the first step compiles
  clock.pause_after(3)  # an evaluation ran after step 3
  for step in (4, 5):
    clock.watch(step, jax.numpy.ones(()))
  assert [clock.step_time(s) for s in (2, 3, 4, 5)] == [2.0, 1.5, None, 0.5]
  clock.close()
