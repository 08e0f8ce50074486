"""Which saved run a training command continues, and when it must not.

A run directory holds one run. The same command resumes it, and a few keys may change on
the way (more steps, another mesh or layout, other logging or checkpoint settings: none of
them changes what the model learns from which data). Any other difference (another batch,
model, data, optimizer or objective) would quietly mix two runs in one directory, so it is
refused in one line that names the keys and the two ways out: another `train.run_dir`, or
`--overwrite` (`Trainer.fit(overwrite=True)`) to replace the saved run.
"""

import shutil
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from jaxpar.cluster.run_lock import LOCK_NAME
from jaxpar.config import Config, checkpoint_dir
from jaxpar.errors import ConfigError

# Keys a resume may change (docs/checkpoints.md lists them), each with everything under it.
SAFE_KEYS = ("train.steps", "train.log_every", "train.run_dir", "train.peak_flops_per_device",
             "train.microbatches", "train.sample_prompt", "train.sample_tokens", "train.sample_temperature",
             "train.sample_top_p", "train.loggers", "model.remat", "model.scan_unroll", "model.attention",
             "mesh", "parallel", "eval", "checkpoint")
# What a run writes into its directory besides checkpoints (jaxpar/train/metrics.py, trackers.py):
# --overwrite removes them, so the new run also starts new tracker runs.
RUN_RECORDS = ("metrics.jsonl", "tensorboard", "trackers.json", "wandb", "mlruns")


def _differences(old, new, key=""):
  if isinstance(old, dict) and isinstance(new, dict):
    for name in sorted(set(old) | set(new)):
      yield from _differences(old.get(name), new.get(name), f"{key}.{name}" if key else name)
  elif old != new:
    yield key, (old, new)


def changed_keys(saved: Config, wanted: Config) -> dict[str, tuple]:
  """The keys that differ and matter: {key: (saved value, wanted value)}."""
  return {key: values for key, values in _differences(saved.model_dump(mode="json"), wanted.model_dump(mode="json"))
          if not any(key == safe or key.startswith(safe + ".") for safe in SAFE_KEYS)}


def check_same_run(saved: Config, wanted: Config, step: int):
  """A one-line ConfigError when `wanted` is not a continuation of the run saved at `step`."""
  changed = changed_keys(saved, wanted)
  if not changed:
    return
  shown = "; ".join(f"{k}: {_short(a)} saved, {_short(b)} now" for k, (a, b) in list(changed.items())[:4])
  more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
  raise ConfigError(f"{wanted.train.run_dir} holds a run saved at step {step} with other settings ({shown}{more}): "
                    f"set train.run_dir=<a new folder> for a new run, or pass --overwrite to replace this one")


def _short(value) -> str:
  text = repr(value)
  return text if len(text) <= 40 else text[:37] + "..."


def finished_line(config: Config, step: int) -> str:
  return (f"{config.train.run_dir} is already at step {step} of train.steps={config.train.steps}: nothing to "
          "train. Raise train.steps to train on, or start fresh with train.run_dir=<a new folder> or --overwrite")


def remove_saved_run(config: Config) -> list[str]:
  """--overwrite: the run's checkpoints and records go, the run lock that `fit` holds stays
  (process 0 removes, every process waits); the names of what was removed."""
  run_dir, checkpoints = Path(config.train.run_dir), checkpoint_dir(config)
  saved = [p for p in checkpoints.iterdir() if p.name != LOCK_NAME] if checkpoints.is_dir() else []
  doomed = saved + [p for p in (run_dir / n for n in RUN_RECORDS) if p.exists()]
  if jax.process_index() == 0:
    for path in doomed:
      shutil.rmtree(path) if path.is_dir() else path.unlink()
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices("jaxpar overwrite")
  return [str(p) for p in doomed]
