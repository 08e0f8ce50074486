"""Small configs and synthetic batches shared by the tests."""

import os
import tempfile

import numpy as np

from jaxpar.config import from_dict

SMALL_MODEL = dict(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, mlp_dim=128, max_seq_len=128)


def small_config(mesh=None, model=None, data=None, train=None, tmp_path=None, checkpoint=None,
                 parallel=None, objective=None):
  tree = {
    "model": {**SMALL_MODEL, **(model or {})},
    "mesh": {"fsdp": -1, "rules": "fsdp_tp", **(mesh or {})},
    "parallel": parallel or {},
    "data": {"seq_len": 32, "global_batch_size": 8, **(data or {})},
    "train": {"steps": 3, "warmup_steps": 1, "log_every": 0,
              # Without a tmp_path, still one run dir per test process: a run dir belongs to
              # one job at a time, and parallel test workers are separate jobs.
              "run_dir": str(tmp_path / "run") if tmp_path else
              os.path.join(tempfile.gettempdir(), f"jaxpar-test-{os.getpid()}"), **(train or {})},
    # Only a test's own tmp run dir gets checkpoints: never resume another test's run.
    "checkpoint": {"enabled": tmp_path is not None, **(checkpoint or {})},
    "objective": objective or {},
  }
  return from_dict(tree)


def synthetic_batch(config, seed=0, documents_per_row=2):
  """A packed batch (numpy) with a document boundary inside every row."""
  rng = np.random.default_rng(seed)
  b, l = config.data.global_batch_size, config.data.seq_len
  inputs = rng.integers(0, 258, (b, l), dtype=np.int32)
  targets = rng.integers(0, 258, (b, l), dtype=np.int32)
  cut = l // documents_per_row
  segment_ids = np.where(np.arange(l) < cut, 1, 2).astype(np.int32)[None].repeat(b, 0)
  positions = np.where(np.arange(l) < cut, np.arange(l), np.arange(l) - cut).astype(np.int32)[None].repeat(b, 0)
  loss_mask = np.ones((b, l), np.float32)
  loss_mask[:, cut - 1] = 0.0
  return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids,
          "positions": positions, "loss_mask": loss_mask}


def gradient_temp_bytes(config, num_devices: int) -> int:
  """Temporaries per device of `config`'s compiled gradient step (fused loss, 128-position
  chunks) on the first `num_devices` devices: what activation memory a change saves."""
  import jax

  from jaxpar.objectives.lm import lm_loss
  from jaxpar.train.step import make_gradients
  from jaxpar.train.trainer import Trainer
  trainer = Trainer(config, devices=jax.devices()[:num_devices])
  params = trainer.abstract_state().params
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
           for k, v in synthetic_batch(config).items()}
  with trainer.context():
    gradients = make_gradients(lm_loss(trainer.graphdef, z_loss=0.0, logits_chunk_len=128), microbatches=1)
    compiled = jax.jit(gradients).lower(params, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def tensorboard_scalars(run_dir) -> dict[str, dict[int, float]]:
  """What TensorBoard itself reads from a run's events: {tag: {step: value}}."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
  events.Reload()
  return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


class counting_compiles:
  """`with counting_compiles() as compiles:` -> the programs compiled inside: every backend
  compile, and every compile served from the persistent compilation cache (a retrace that
  the cache hides is still a recompile). The listeners are removed on exit."""

  _COMPILED = "/jax/core/compile/backend_compile_duration"
  _CACHE_HIT = "/jax/compilation_cache/cache_hits"

  def __enter__(self) -> list:
    import jax
    self.events = []
    self._duration = lambda name, *_, **__: self.events.append(name) if name == self._COMPILED else None
    self._event = lambda name, *_, **__: self.events.append(name) if name == self._CACHE_HIT else None
    jax.monitoring.register_event_duration_secs_listener(self._duration)
    jax.monitoring.register_event_listener(self._event)
    return self.events

  def __exit__(self, *exc):
    import jax
    jax.monitoring.unregister_event_duration_listener(self._duration)
    jax.monitoring.unregister_event_listener(self._event)
