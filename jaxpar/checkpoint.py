"""Orbax checkpoints: train state + data iterator state + resolved config, on any mesh.

A checkpoint is one step directory of items: `params`, `opt_state` and, when the model has
non-parameter variables, `model_state` (sharded arrays, written per shard), `data` (the
iterator state, JSON) and `config` (the resolved config, JSON). Orbax writes each step into a temporary directory and renames it when
complete, so a save killed half-way never shows up as a step. Restores read into the
*target* shardings: every device reads just its own shard, whatever mesh wrote it.
"""

import logging
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jaxpar.config import CheckpointConfig
from jaxpar.errors import CheckpointError

_ARRAYS = ("params", "opt_state", "model_state")
# Beside the step directories: the tokenizer files the model was trained or imported with.
TOKENIZER_DIR = "tokenizer"
_JSON = ("data", "config")
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax writes step N into N<suffix>, then renames it


class _QuietReadOnlyOpen(logging.Filter):
  """Orbax warns `Given directory is read only=...` whenever a directory is opened for
  reading, however writable it is: that is our choice (restores never write), not news."""

  def filter(self, record):
    return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_QuietReadOnlyOpen())


def _handlers():
  return {**{k: ocp.StandardCheckpointHandler() for k in _ARRAYS},
          **{k: ocp.JsonCheckpointHandler() for k in _JSON}}


def _save_policy(options: CheckpointConfig):
  schedule = []
  if options.every_steps:
    schedule.append(policies.FixedIntervalPolicy(options.every_steps))
  if options.every_minutes:
    # Saves at the first step when no checkpoint exists yet, then every N minutes; decided on
    # the primary host and broadcast, so all processes agree.
    schedule.append(policies.ContinuousCheckpointingPolicy(
        minimum_interval_secs=max(1, round(options.every_minutes * 60))))
  # An empty schedule never saves: only forced saves (end of training, preemption).
  return policies.AnySavePolicy(schedule)


def _preservation_policy(options: CheckpointConfig):
  keep = [policies.LatestN(options.keep_last)]
  if options.keep_every:
    keep.append(policies.EveryNSteps(options.keep_every))
  return policies.AnyPreservationPolicy(keep)


def _leaf_name(path) -> str:
  """'layers.attn.q' for params; 'opt_state.1.0.mu.embed' style for optimizer leaves (orbax
  stores namedtuples as dicts and tuples as lists, so names, not key types, are compared)."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
  return ".".join(parts)


def _shapes(tree) -> dict[str, tuple]:
  leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
  return {_leaf_name(path): tuple(leaf.shape) for path, leaf in leaves}


class Checkpointer:
  """One run's checkpoint directory: scheduled async saves, restores onto any mesh.

  `read_only=True` opens an existing directory without creating or deleting anything
  (for `--restore`, fine-tuning and inference).
  """

  def __init__(self, directory, options: CheckpointConfig = CheckpointConfig(), *, read_only=False):
    self.directory = Path(directory).absolute()
    if read_only and not self.directory.is_dir():
      raise CheckpointError(f"checkpoint directory {self.directory} does not exist: check the path "
                       "(checkpoints live in <train.run_dir>/checkpoints unless checkpoint.dir is set)")
    # What a killed save left behind (Orbax removes it below; listed so the user hears of it).
    self.leftovers = [] if read_only else sorted(
        p.name for p in self.directory.glob(f"*{_TMP_SUFFIX}*"))
    self.manager = ocp.CheckpointManager(
        self.directory, item_handlers=_handlers(),
        options=ocp.CheckpointManagerOptions(
            read_only=read_only, create=not read_only,
            save_interval_steps=0 if read_only else 1,  # what Orbax forces (with a warning) when reading
            # A crash leaves a half-written tmp step dir: never listed as a step; removed here.
            cleanup_tmp_directories=not read_only,
            enable_async_checkpointing=options.async_save,
            save_decision_policy=_save_policy(options),
            preservation_policy=_preservation_policy(options)))
    self.last_save_blocked_s = 0.0  # how long the last save held up the caller

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def path(self, step: int) -> Path:
    return self.directory / str(step)

  def save(self, step: int, state: dict, *, data_state: dict | None = None, config=None,
           force: bool = False) -> bool:
    """Save `state` ({"params", "opt_state", "model_state"}; a params-only state for an
    imported model) if the schedule says so (or `force`); returns whether a save started.
    Async: only the device-to-host copy blocks; `wait()` blocks until the files are complete."""
    if step in self.all_steps():
      return False
    started = time.perf_counter()
    items = {k: ocp.args.StandardSave(state[k]) for k in _ARRAYS
             if k in state and jax.tree.leaves(state[k])}  # no empty items (no model_state)
    items["data"] = ocp.args.JsonSave(data_state or {})
    items["config"] = ocp.args.JsonSave(config.model_dump(mode="json") if config is not None else {})
    saved = self.manager.save(step, args=ocp.args.Composite(**items), force=force)
    if saved:
      self.last_save_blocked_s = time.perf_counter() - started
    return saved

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()

  def pick_step(self, step: int | None = None) -> int:
    """`step` if this directory holds it complete; None: the latest."""
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"{self.directory} holds no complete checkpoint: train first, or point "
                       "at a directory with numbered step subdirectories")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise CheckpointError(f"{self.directory} has no checkpoint at step {step}; it has steps {steps}")
    return step

  def stored_shapes(self, step: int, item: str) -> dict[str, tuple]:
    """{leaf name ('a.b.c'): shape} of an array item of `step`, read from its metadata alone."""
    return _shapes(self._read(step, lambda: self.manager.item_metadata(step)[item].tree))

  def _check_shapes(self, step: int, item: str, target):
    """Compare stored and target shapes leaf by leaf before reading anything."""
    stored = self.stored_shapes(step, item)
    wanted = _shapes(target)
    where = f"checkpoint {self.path(step)}"
    for name, shape in wanted.items():
      if name not in stored:
        raise CheckpointError(f"{where} has no {item} entry {name!r}: it was written for a different "
                         f"model or optimizer; restore with the config it was saved with ({where}/config)")
      if stored[name] != shape:
        raise CheckpointError(f"{where}: {item} {name!r} has shape {stored[name]} but this model expects "
                         f"{shape}; restore with the model config it was saved with ({where}/config)")
    extra = sorted(set(stored) - set(wanted))
    if extra:
      raise CheckpointError(f"{where} has {item} entry {extra[0]!r} that this model lacks: it was written "
                       f"for a different model or optimizer ({where}/config)")

  def _read(self, step: int, fn):
    try:
      return fn()
    except Exception as e:  # orbax/tensorstore raise many types for unreadable files
      first = str(e).splitlines()[0] if str(e) else ""
      raise CheckpointError(f"checkpoint {self.path(step)} is unreadable ({type(e).__name__}: {first}): "
                       f"it is corrupt or incomplete; restore another step of {self.all_steps()}") from e

  def restore(self, abstract_state: dict, step: int | None = None) -> tuple[dict, dict]:
    """(train state placed per `abstract_state`'s shardings, data iterator state) of `step`
    (default: the latest complete one). A params-only checkpoint gives `opt_state` None."""
    step = self.pick_step(step)
    wanted_state = jax.tree.leaves(abstract_state.get("model_state", {}))
    if wanted_state and not (self.path(step) / "model_state").is_dir():
      raise CheckpointError(f"checkpoint {self.path(step)} has no model_state but this model has "
                       "non-parameter variables: it was written for a different model")
    arrays = [k for k in _ARRAYS if k == "params" or (self.path(step) / k).is_dir()
              and (k != "model_state" or wanted_state)]
    for item in arrays:
      self._check_shapes(step, item, abstract_state[item])
    items = {k: ocp.args.StandardRestore(abstract_state[k]) for k in arrays}
    restored = self._read(step, lambda: self.manager.restore(
        step, args=ocp.args.Composite(**items, data=ocp.args.JsonRestore())))
    step_array = jax.device_put(jnp.asarray(step, abstract_state["step"].dtype),
                                abstract_state["step"].sharding)
    state = {"step": step_array, "params": restored["params"], "opt_state": restored.get("opt_state"),
             "model_state": restored.get("model_state", {})}
    return state, dict(restored["data"] or {})

  def restore_params(self, abstract_params: dict, step: int | None = None) -> dict:
    """Just the parameters (fine-tuning, inference): the optimizer state is never read."""
    return self.restore_item("params", abstract_params, step)

  def restore_item(self, item: str, abstract: dict, step: int | None = None) -> dict:
    """One array item (`params`, `model_state`) of `step`, placed per `abstract`'s shardings."""
    step = self.pick_step(step)
    if not jax.tree.leaves(abstract):
      return {}
    if not (self.path(step) / item).is_dir():
      raise CheckpointError(f"checkpoint {self.path(step)} has no {item}: it was written for a different model")
    self._check_shapes(step, item, abstract)
    restored = self._read(step, lambda: self.manager.restore(
        step, args=ocp.args.Composite(**{item: ocp.args.StandardRestore(abstract)})))
    return restored[item]

  def saved_config(self, step: int | None = None) -> dict:
    """The resolved config the checkpoint was written with, as a dict."""
    step = self.pick_step(step)
    return self._read(step, lambda: self.manager.restore(
        step, args=ocp.args.Composite(config=ocp.args.JsonRestore())))["config"]
