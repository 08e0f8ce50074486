"""Where each step's scalars go besides metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

`train.loggers` names them. Each gets the same scalars under the same tags (`train/loss`,
`eval/NAME/loss`); wandb and mlflow also get the resolved config. A run keeps one tracker
run across its starts: the first start writes `<run_dir>/trackers.json` with each one's run
id, and a later start (a resume) continues those runs. wandb and mlflow are imported only
when named, so the plain install needs neither.
"""

import json
import os
import re
import time
from pathlib import Path

import yaml

from jaxpar.errors import ConfigError

IDS_FILE = "trackers.json"


def tag(key: str) -> str:
  """A metric's tag: eval/NAME/loss stays as it is; the rest is train/..."""
  return key if key.startswith("eval/") else f"train/{key}"


def check_installed(names):
  """A one-line ConfigError for a named tracker whose library is missing (tensorboardX comes
  with the plain install); the trainer calls it before anything compiles."""
  for name in names:
    try:
      if name == "wandb":
        import wandb  # noqa: F401
      elif name == "mlflow":
        import mlflow.tracking  # noqa: F401
    except ImportError:
      raise ConfigError(f"train.loggers includes {name}, which is not installed: "
                        f"pip install 'jaxpar[{name}]'") from None


class Tracker:
  """One destination of the scalars. `run_id`: what a resume needs to continue its run (None: nothing)."""
  run_id: str | None = None

  def log(self, step: int, scalars: dict[str, float]):
    raise NotImplementedError

  def close(self):
    pass


class TensorBoardTracker(Tracker):
  """Event files in <run_dir>/tensorboard; opened by the first record, so a start that
  trains nothing adds no file."""

  def __init__(self, run_dir, start_step: int):
    self.directory = Path(run_dir) / "tensorboard"
    self.start_step = start_step
    self.writer = None

  def log(self, step, scalars):
    if self.writer is None:
      from tensorboardX import SummaryWriter
      # purge_step: TensorBoard drops what an earlier, interrupted start wrote past the
      # checkpoint. The suffix: two starts in one second would otherwise share a file name.
      self.writer = SummaryWriter(str(self.directory), purge_step=self.start_step + 1,
                                  filename_suffix=f".from{self.start_step}")
    for key, value in scalars.items():
      self.writer.add_scalar(tag(key), value, step)

  def close(self):
    if self.writer is not None:
      self.writer.close()


class WandbTracker(Tracker):
  """A wandb run (project $WANDB_PROJECT, default jaxpar) named after the run dir; its local
  files go under <run_dir>/wandb. The mode is the user's: WANDB_MODE=offline needs no account."""

  def __init__(self, run_dir, config: dict, run_id: str | None):
    import wandb
    # resume="allow": a known id continues that run (None: wandb makes a new one). allow_val_change:
    # a resume may change train.steps and the other safe keys, which wandb otherwise refuses.
    # reinit="create_new": a run of the user's own (in a notebook, say) is neither reused nor ended.
    self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxpar"), name=Path(run_dir).name,
                          dir=str(run_dir), id=run_id, resume="allow", config=config,
                          allow_val_change=True, reinit="create_new")
    self.run_id = self.run.id

  def log(self, step, scalars):
    self.run.log({tag(k): v for k, v in scalars.items()}, step=step)

  def close(self):
    self.run.finish()


class MlflowTracker(Tracker):
  """An MLflow run in $MLFLOW_TRACKING_URI (default: a file store, <run_dir>/mlruns), in
  experiment $MLFLOW_EXPERIMENT_NAME (default jaxpar). Through MlflowClient, so no global
  active run is touched."""

  def __init__(self, run_dir, config: dict, run_id: str | None):
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient
    self.uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not self.uri:
      # MLflow 3 opens its file store only when asked (MLFLOW_ALLOW_FILE_STORE): the client
      # alone (mlflow-skinny) has no database store, and files in the run dir need no server.
      os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
      self.uri = (Path(run_dir).absolute() / "mlruns").as_uri()
    self.client = MlflowClient(tracking_uri=self.uri)
    run = self._existing(run_id)
    if run is None:
      name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "jaxpar")
      experiment = self.client.get_experiment_by_name(name)
      experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
      run = self.client.create_run(experiment_id, run_name=Path(run_dir).name)
    elif run.info.status != "RUNNING":
      self.client.update_run(run.info.run_id, status="RUNNING")
    self.run_id = run.info.run_id
    # config.yaml is rewritten by each start (a resume may change safe keys). Params are
    # write-once in MLflow, so they keep the first start's values; keys it cannot hold are skipped.
    self.client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "config.yaml")
    params = [Param(k, v) for k, v in _flat(config).items()
              if k not in run.data.params and _fits_param(k, v)]
    for i in range(0, len(params), 100):  # log_batch takes at most 100 params a call
      self.client.log_batch(self.run_id, params=params[i:i + 100])

  def _existing(self, run_id):
    """The run to continue, when trackers.json names one this store holds (the tracking URI
    may have changed since: then a new run)."""
    if run_id is None:
      return None
    from mlflow.exceptions import MlflowException
    try:
      run = self.client.get_run(run_id)
    except MlflowException:
      return None
    return None if run.info.lifecycle_stage == "deleted" else run

  def log(self, step, scalars):
    from mlflow.entities import Metric
    now = int(time.time() * 1000)
    metrics = [Metric(tag(k), v, now, step) for k, v in scalars.items()]
    for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics a call
      self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

  def close(self):
    self.client.set_terminated(self.run_id)


def _flat(tree: dict, prefix: str = "") -> dict[str, str]:
  """{"train": {"steps": 4}} -> {"train.steps": "4"}: the config as MLflow params (strings;
  other values as JSON)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
  return out


def _fits_param(key: str, value: str) -> bool:
  # MLflow's limits: keys of letters, digits and _-. /: up to 250 characters, values up to 6000.
  return len(key) <= 250 and len(value) <= 6000 and re.fullmatch(r"[\w.\- /:]+", key) is not None


def open_trackers(names, run_dir, config: dict, start_step: int) -> list[Tracker]:
  """The trackers `names` asks for, continuing the runs <run_dir>/trackers.json names; the
  file is written with the ids of this start's runs."""
  run_dir = Path(run_dir)
  path = run_dir / IDS_FILE
  ids = json.loads(path.read_text()) if path.exists() else {}
  trackers = []
  try:
    for name in names:
      if name == "tensorboard":
        trackers.append(TensorBoardTracker(run_dir, start_step))
      elif name == "wandb":
        trackers.append(WandbTracker(run_dir, config, ids.get(name)))
      elif name == "mlflow":
        trackers.append(MlflowTracker(run_dir, config, ids.get(name)))
  except BaseException:
    for tracker in trackers:
      tracker.close()
    raise
  # Ids of trackers not used this time stay: a later start that names them again continues them.
  updated = {**ids, **{name: t.run_id for name, t in zip(names, trackers) if t.run_id is not None}}
  if updated != ids:
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(updated, indent=1) + "\n")
    partial.replace(path)
  return trackers
