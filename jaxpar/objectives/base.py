"""The objective protocol and its registry: what a training objective brings to the trainer.

An objective is a registered class. The trainer names none: it asks the one that
`train.objective` names for
- its batches (`batches`: an endless iterator of global batches, from any data source the
  readers take, with `get_state`/`set_state` to resume where it stopped);
- its loss and metrics (`loss`: a function of the trained weights, the model state, a batch
  and the frozen weights, returning the summed loss and a dict of sums that the step divides
  by `sums["tokens"]`; "ce_sum" is reported as `loss`, "metric/NAME" and "loss/NAME" as NAME);
- what it keeps beside the policy (`kept_networks`: copies of the network, e.g. DPO's
  reference, read from a checkpoint or the seeded init, never trained or saved;
  `policy_start`: the kept network the policy starts as);
- its options (`Options`, the config's `objective:` section) and checks (`check`), run
  before anything compiles.
Objectives that generate (reinforcement learning's rollouts, distillation's teacher) do so
inside `batches`, from the trainer's runtime and the weights `batches` is handed each step:
the trainer calls `batches.follow(state)` before each `next(batches)` where it has one, and
logs `batches.host_metrics()` (a dict of floats) beside the step's, and adds
`batches.finish(state)` (a dict) to the run's summary at its end. An objective whose
batches carry other arrays than the language model's names them in `batch_keys`.
"""

import logging
from typing import ClassVar

from flax import nnx

from jaxpar.data.loader import KEYS
from jaxpar.errors import ConfigError
from jaxpar.models.config import Frozen
from jaxpar.trees import join

_log = logging.getLogger(__name__)
BASE = "base"  # TrainState.frozen's key for the base weights under adapters (model.lora)


def model_state_of(model) -> dict:
  """What a loss returns beside its sums: the model's non-parameter state after the forward
  (a router's bias, say), as a plain dict."""
  return nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))


def policy_weights(params: dict, frozen: dict | None) -> dict:
  """The policy's whole weights: the trained ones, joined with the base under adapters."""
  return join(params, frozen[BASE]) if frozen and BASE in frozen else params


class Options(Frozen):
  """An objective's keys (the config's `objective:` section); none by default."""


class Objective:
  name: ClassVar[str]
  formats: ClassVar[tuple[str, ...]]  # the data.format values it trains on
  Options: ClassVar[type[Options]] = Options
  batch_keys: ClassVar[tuple[str, ...]] = KEYS

  def __init__(self, config, runtime, devices=None):
    """devices: every device the trainer was given (default: the runtime's mesh)."""
    self.config, self.runtime = config, runtime
    self.devices = list(runtime.mesh.devices.flat) if devices is None else list(devices)
    self.options = config.objective
    self.check()

  @classmethod
  def train_devices(cls, config, devices: list) -> list:
    """The devices the policy trains on, of those given (all of them by default)."""
    return devices

  def check(self):
    """One-line ConfigErrors for what this objective cannot train, before anything compiles."""
    fmt = self.config.data.format
    if fmt not in self.formats:
      readers = [n for n, cls in OBJECTIVES.items() if fmt in cls.formats]
      raise ConfigError(f"train.objective={self.name} trains on data.format={'|'.join(self.formats)} rows, not "
                        f"data.format={fmt}: set data.format={self.formats[0]}"
                        + (f", or train.objective={readers[0]} for {fmt} rows" if readers else ""))
    if self.config.model.medusa is not None and self.name != "medusa":
      raise ConfigError(f"model.medusa holds draft heads, which only train.objective=medusa trains (not "
                        f"{self.name}): set train.objective=medusa, or drop model.medusa")

  @property
  def adapters(self) -> bool:
    return self.runtime.adapter_mask is not None

  def batches(self, tokenizer, sharding):
    raise NotImplementedError

  def loss(self):
    raise NotImplementedError

  def kept_networks(self) -> dict[str, str | None]:
    """{name: checkpoint path (None: the model's seeded init)} of whole networks kept beside
    the policy in TrainState.frozen; none by default."""
    return {}

  policy_start: str | None = None  # a kept network the fresh policy copies (a class or instance attribute)


OBJECTIVES: dict[str, type[Objective]] = {}
# Imports the objective modules and entry points (set by the package): on first use, not at
# import, since objectives that generate import the engine, which imports the config, which
# imports this registry.
_plugins = {"load": None}


def registered() -> dict[str, type[Objective]]:
  """Every objective, the plug-ins imported on the first call."""
  load, _plugins["load"] = _plugins["load"], None
  if load is not None:
    load()
  return OBJECTIVES


def register_objective(cls: type[Objective]) -> type[Objective]:
  """Class decorator: make `cls` the objective `train.objective=cls.name` selects."""
  if cls.name in OBJECTIVES and OBJECTIVES[cls.name] is not cls:
    raise ValueError(f"objective {cls.name!r} is registered twice")
  OBJECTIVES[cls.name] = cls
  return cls


def get_objective(name: str) -> type[Objective]:
  if name not in registered():
    raise ConfigError(f"train.objective={name!r} is not a registered objective; choose one of {sorted(OBJECTIVES)}")
  return OBJECTIVES[name]


# Keys that configs written before objectives were plug-ins kept under `train`.
_MOVED = {"dpo_beta": "beta", "dpo_reference": "reference"}


def migrate_objective_keys(tree: dict) -> dict:
  """A config tree with the old `train.dpo_beta` / `train.dpo_reference` moved to the objective
  section, and chat rows given `sft` where the objective is unset or the old `lm` (a note
  for each key said outright).
  Saved checkpoints' configs restore through this."""
  train, data = dict(tree.get("train") or {}), tree.get("data") or {}
  objective = dict(tree.get("objective") or {})
  moved = [k for k in _MOVED if k in train]
  for old in moved:
    value = train.pop(old)
    if train.get("objective") == "dpo":  # another objective never read these keys
      objective.setdefault(_MOVED[old], value)
    _log.warning("train.%s is deprecated: it moved to objective.%s", old, _MOVED[old])
  if data.get("format") == "chat" and train.get("objective", "lm") == "lm":
    if "objective" in train:  # said outright (a saved config): say what it means now
      _log.warning("data.format=chat trains with train.objective=sft now (set it; lm reads text)")
    train["objective"] = "sft"
  elif not moved:
    return tree
  return {**tree, "train": train, "objective": objective}
