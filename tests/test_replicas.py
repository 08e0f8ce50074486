"""train.sync: DiLoCo, Streaming DiLoCo and SparseLoCo replicas on 8 simulated devices
(data=4 x fsdp=2): the exact reduction to all-reduce training, the traffic read from the
compiled programs against the hand count, the compression's numerics, resume, config errors."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.aot import hlo
from jaxpar.aot.compile import abstract_batch, compile_step, data_sync_traffic
from jaxpar.config import load_config
from jaxpar.errors import ConfigError
from jaxpar.train.replicas import compress
from jaxpar.train.replicas.fragments import Fragments, put, take
from jaxpar.train.trainer import Trainer

pytestmark = [pytest.mark.xdist_group("replicas")]

SMALL = ["model.num_layers=2", "model.scan_unroll=2", "mesh.data=4", "mesh.fsdp=2", "data.global_batch_size=8",
         "data.seq_len=32", "eval.every_steps=0", "train.sample_tokens=0", "train.log_every=0",
         "train.warmup_steps=1"]


def _config(*overrides, tmp_path=None, name="tiny"):
  run = [f"train.run_dir={tmp_path}"] if tmp_path else ["checkpoint.enabled=false"]
  return load_config(name, SMALL + run + list(overrides))


# -- compression -----------------------------------------------------------------------

def test_quantize_decodes_within_half_a_level_and_packs_the_counted_bytes():
  x = jax.random.normal(jax.random.key(0), (3, 5, 40))  # 200 values: one partial 64-value row
  for bits in (8, 4, 2):
    payload = compress.quantize(x, bits=bits, chunk=64)
    back = compress.decode(payload, bits=bits, chunk=64, shape=x.shape[1:])
    rows = compress.rows(x, 64)
    scale = jnp.max(jnp.abs(rows), axis=-1, keepdims=True)
    half = (scale / (2 ** bits - 1)) * 1.01 + 1e-6  # half a level, and the scale's bfloat16 rounding
    error = jnp.abs(compress.rows(back, 64) - rows)
    assert bool(jnp.all(error[..., :200 % 64 or 64] <= half)), bits
    per_replica = sum(a[0].nbytes for a in jax.tree.leaves(payload))
    assert per_replica == compress.payload_bytes(200, bits=bits, chunk=64)


def test_sparsify_sends_each_rows_largest_values_and_nothing_else():
  x = jax.random.normal(jax.random.key(1), (2, 256))
  payload = compress.sparsify(x, bits=8, chunk=128, kept=4)
  back = compress.decode(payload, bits=8, chunk=128, shape=(256,))
  for replica in range(2):
    for row in range(2):
      values = np.asarray(x[replica, row * 128:(row + 1) * 128])
      got = np.asarray(back[replica, row * 128:(row + 1) * 128])
      top = set(np.argsort(-np.abs(values))[:4])
      assert set(np.flatnonzero(got)) == top
      np.testing.assert_allclose(got[list(top)], values[list(top)], atol=np.abs(values).max() / 254 * 1.01)
  assert sum(a[0].nbytes for a in jax.tree.leaves(payload)) == compress.payload_bytes(256, bits=8, chunk=128, kept=4)


# -- training --------------------------------------------------------------------------

def _losses_and_params(config, steps):
  trainer = Trainer(config)
  result = trainer.fit(steps=steps, show_progress=False)
  return [h["loss"] for h in result.history], jax.device_get(result.state.params)


@pytest.mark.parametrize("name, layout", [
    ("tiny", []), ("tiny", ["mesh.data=2", "mesh.tensor=2"]), ("tiny", ["model.lora.rank=4"]),
    ("tiny-moe", ["mesh.data=2", "mesh.fsdp=1", "mesh.context=2", "mesh.expert=2"]),
    ("tiny", ["mesh.data=2", "mesh.stage=2"])],
    ids=["data4-fsdp2", "data2-fsdp2-tensor2", "lora", "moe-data2-context2-expert2", "pipeline-data2-stage2-fsdp2"])
def test_diloco_every_step_with_outer_lr_1_is_allreduce_training(name, layout):
  """H=1, outer learning rate 1, no momentum: the anchor becomes the replicas' mean after one
  SGD step each, which is one SGD step on the mean gradient (equal tokens per replica); with
  tensor parallelism inside each replica, with adapters over a frozen base, with ring
  attention and expert-parallel dispatch, and with a pipeline inside each replica (their
  shard_maps under the replicas' vmap)."""
  plain = ["train.optimizer=sgd", "train.grad_clip=null", "train.weight_decay=0.0", *layout]
  losses, params = _losses_and_params(_config(*plain, name=name), 3)
  synced, synced_params = _losses_and_params(_config(*plain, "train.sync=diloco", "train.diloco.every=1",
                                                     "train.diloco.outer_learning_rate=1.0",
                                                     "train.diloco.outer_momentum=0.0", name=name), 3)
  np.testing.assert_allclose(synced, losses, rtol=1e-5)
  # Expert dispatch sums a parameter's gradient in another order per replica: a few of 65536
  # values land 1.7e-6 apart (parameters near 0.1).
  atol = 5e-6 if name == "tiny-moe" else 1e-6
  for a, b in zip(jax.tree.leaves(synced_params), jax.tree.leaves(params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=atol)
  assert losses[-1] < losses[0]


def _crossing_data(trainer, program):
  with trainer.context():
    compiled = program.lower(trainer.abstract_state(), abstract_batch(trainer)).compile()
  coords = hlo.axis_coordinates(trainer.mesh, "data")
  return [c for c in hlo.collectives(compiled.as_text(), coords, cpu=True) if c.dcn]


def test_traffic_over_data_read_from_the_compiled_programs():
  baseline = sum(c.wire_bytes for c in _crossing_data(*(lambda t: (t, t.train_step))(Trainer(_config()))))
  assert baseline > 0

  streaming = Trainer(_config("train.sync=streaming_diloco", "train.diloco.fragments=2", "train.diloco.every=32"))
  replicas, n = streaming.replicas, streaming.replicas.replicas
  assert _crossing_data(streaming, replicas.program(None)) == []  # the inner step: nothing crosses `data`
  per_period = 0.0
  for fragment in range(2):
    found = _crossing_data(streaming, replicas.program(fragment))
    gathered = sum(c.bytes for c in found if c.kind == "all-gather")
    assert gathered == n * replicas.sent_bytes(fragment)  # every replica's 4-bit codes and scales, exactly
    assert sum(c.bytes for c in found if c.kind != "all-gather") <= 64  # the drift's scalars
    per_period += sum(c.wire_bytes for c in found)
  assert baseline / (per_period / 32) >= 100

  sparse = Trainer(_config("train.sync=sparseloco"))
  found = _crossing_data(sparse, sparse.replicas.program(0))
  assert sum(c.bytes for c in found if c.kind == "all-gather") == n * sparse.replicas.sent_bytes(0)
  assert all(c.dtype in ("u8", "u16") for c in found if c.kind == "all-gather")  # codes, positions, scales
  # What `jaxpar compile` reports: per step, the sync's bytes over its period, at the least it can send.
  report = data_sync_traffic(sparse, compile_step(sparse)[0])
  assert report["programs"]["inner"] == 0 and report["per_step"] == report["programs"]["sync 0"] / 16
  assert report["least_per_step"] <= report["per_step"] <= report["least_per_step"] + 64 / 16

  dense = Trainer(_config("train.sync=diloco"))
  found = _crossing_data(dense, dense.replicas.program(0))
  reduced = sum(c.bytes for c in found if c.kind == "all-reduce")
  assert dense.replicas.sent_bytes(0) <= reduced <= dense.replicas.sent_bytes(0) + 64
  assert not [c for c in found if c.kind != "all-reduce"]


def test_fragments_over_a_pipeline_take_a_block_of_every_stages_layers():
  """Layers split over 2 stages (rows 0-3 on one, 4-7 on the other), 2 fragments: fragment 1
  holds rows 2-3 and 6-7, so each stage syncs its own layers in place; put undoes take."""
  fragments = Fragments([("layers", "embed"), ("embed",)], [(8, 3), (3,)], 2, [2, 1])
  stack = jnp.arange(24.0).reshape(8, 3)
  part, whole = fragments.parts(1, [(8, 3), (3,)])
  assert whole is None  # the embeddings travel with fragment 0
  np.testing.assert_array_equal(take(stack, part), stack[jnp.array([2, 3, 6, 7])])
  np.testing.assert_array_equal(put(stack, -take(stack, part), part)[jnp.array([0, 1, 4, 5])],
                                stack[jnp.array([0, 1, 4, 5])])
  np.testing.assert_array_equal(put(stack, -take(stack, part), part)[jnp.array([2, 3, 6, 7])],
                                -stack[jnp.array([2, 3, 6, 7])])
  stacked = jnp.stack([stack, stack + 100])  # [replicas, layers, ...]: the layer axis second
  np.testing.assert_array_equal(take(stacked, part, axis=1)[1], stack[jnp.array([2, 3, 6, 7])] + 100)


def test_streaming_over_a_pipeline_sends_the_hand_count_and_nothing_between_syncs():
  """Streaming DiLoCo with a 2-stage pipeline inside each of 2 replicas: the inner step sends
  nothing over `data`, and each sync all-gathers exactly every replica's 4-bit codes."""
  trainer = Trainer(_config("train.sync=streaming_diloco", "train.diloco.fragments=2", "train.diloco.every=32",
                            "model.num_layers=4", "model.scan_unroll=1", "mesh.data=2", "mesh.stage=2"))
  replicas = trainer.replicas
  assert _crossing_data(trainer, replicas.program(None)) == []
  for fragment in range(2):
    found = _crossing_data(trainer, replicas.program(fragment))
    gathered = sum(c.bytes for c in found if c.kind == "all-gather")
    assert gathered == replicas.replicas * replicas.sent_bytes(fragment) > 0
    assert sum(c.bytes for c in found if c.kind != "all-gather") <= 64  # the drift's scalars


@pytest.mark.tpu
def test_moe_replicas_inner_step_sends_nothing_over_data_on_tpu():
  """The real TPU compiler (2 x v5e-4, `data` across the slices): an MoE replica with ring
  attention and expert dispatch inside sends 0 bytes over `data` between syncs. (XLA's CPU
  backend gathers a top_k's operand over every batch axis, so the 8-CPU-device program does
  send the router scores.)"""
  from jaxpar.aot.compile import compile_for_topology
  config = _config("train.sync=diloco", "mesh.data=2", "mesh.fsdp=1", "mesh.context=2", "mesh.expert=2",
                   name="tiny-moe")
  report, _ = compile_for_topology(config, "v5e-4", 2)
  assert report["data_sync"]["programs"]["inner"] == 0 < report["data_sync"]["programs"]["sync 0"]


def test_streaming_resume_mid_period_continues_bit_for_bit(tmp_path):
  overrides = ["train.sync=streaming_diloco", "train.diloco.fragments=2", "train.diloco.every=4", "train.steps=6"]
  whole, _ = _losses_and_params(_config(*overrides, tmp_path=tmp_path / "whole"), None)
  first = Trainer(_config(*overrides, tmp_path=tmp_path / "split")).fit(steps=3, show_progress=False)
  resumed = Trainer(_config(*overrides, tmp_path=tmp_path / "split")).fit(show_progress=False)
  assert [h["step"] for h in resumed.history] == [4, 5, 6]
  # A step that compiles a program it is the first to run (1; 2, fragment 0's sync) has no step time.
  assert ["step_time_s" in h for h in first.history] == [False, False, True]
  assert [h["loss"] for h in first.history + resumed.history] == whole
  assert "sync/drift" in resumed.history[0] and "sync/drift" not in resumed.history[1]  # steps 4 and 6 sync

  with pytest.raises(ConfigError, match="holds 4 train.sync replicas but mesh.data is 2"):
    Trainer(load_config("tiny", SMALL + overrides + [f"train.run_dir={tmp_path / 'split'}", "mesh.data=2",
                                                   "mesh.fsdp=4", "train.steps=8"])).fit(show_progress=False)


def _losses(run_dir) -> list:
  return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sigterm_mid_period_then_the_same_command_continues_bit_for_bit(tmp_path):
  """`jaxpar train` with Streaming DiLoCo, stopped by SIGTERM between two syncs (each fragment's
  replicas have drifted apart), then the same command again: every step's loss equals an
  uninterrupted run's, to the last bit."""
  overrides = SMALL + ["train.sync=streaming_diloco", "train.diloco.fragments=2", "train.diloco.every=4",
                       "train.steps=8", "train.log_every=1"]
  Trainer(load_config("tiny", overrides + [f"train.run_dir={tmp_path / 'whole'}"])).fit(show_progress=False)
  command = [sys.executable, "-m", "jaxpar", "train", "tiny", *overrides, f"train.run_dir={tmp_path / 'stopped'}",
             "--no-progress"]
  env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
  output = []
  for line in child.stdout:
    output.append(line)
    if line.split()[:2] == ["step", "3"]:  # fragment 0 synced after step 2, fragment 1 syncs after 4
      child.send_signal(signal.SIGTERM)
      break
  output += child.stdout.read()
  assert child.wait(120) == 0 and "stopped by SIGTERM" in "".join(output), "".join(output)
  stopped = len(_losses(tmp_path / "stopped"))
  assert 3 <= stopped < 8
  finished = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
  assert finished.returncode == 0, finished.stdout + finished.stderr
  assert _losses(tmp_path / "stopped") == _losses(tmp_path / "whole")


@pytest.mark.parametrize("overrides, message", [
    (["mesh.data=1", "mesh.fsdp=8", "train.sync=diloco"], "`data` mesh axis, which has 1 device"),
    (["train.sync=streaming_diloco", "train.diloco.fragments=4", "train.diloco.every=8"],
     "fragments=4 does not divide a stack of 2 layers"),
    (["train.sync=sparseloco", "train.diloco.density=0.01"], "keeps 1 of each 128-value chunk"),
    (["train.sync=diloco", "train.diloco.fragments=2"], "fragments=2 splits the layers"),
    (["mesh.data=2", "mesh.stage=2", "model.num_layers=4", "train.sync=streaming_diloco", "train.diloco.fragments=4",
      "train.diloco.every=8"], "fragments=4 does not divide a stack of 2 layers per pipeline stage"),
])
def test_bad_sync_settings_are_one_line_errors(overrides, message):
  with pytest.raises((ConfigError, ValueError), match=message) as error:
    Trainer(load_config("tiny", SMALL + overrides))
  assert "\n" not in str(error.value)
