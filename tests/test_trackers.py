"""train.loggers: wandb (offline) and MLflow (a local file store) get the same metrics as
metrics.jsonl, the resolved config, and keep one tracker run across a resume, read back
with each library's own reader; a missing library is one line naming the extra."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import yaml

from jaxpar.errors import ConfigError
from jaxpar.train.trackers import check_installed
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config, tensorboard_scalars

LOGGERS = ["tensorboard", "wandb", "mlflow"]


def _config(tmp_path, steps):
  return small_config(mesh={"fsdp": 1}, data={"seq_len": 16, "global_batch_size": 4}, tmp_path=tmp_path,
                      train={"steps": steps, "log_every": 1, "sample_tokens": 0, "loggers": LOGGERS},
                      checkpoint={"every_steps": 2})


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  """Two steps (checkpoint at 2), then the same run raised to four steps: a resume."""
  tmp_path = tmp_path_factory.mktemp("trackers")
  with pytest.MonkeyPatch.context() as env:
    env.setenv("WANDB_MODE", "offline")
    env.setenv("WANDB_SILENT", "true")
    env.setenv("WANDB_ERROR_REPORTING", "false")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing under ~
      env.setenv(name, str(tmp_path / "wandb-home"))
    for name in ("WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):  # the defaults
      env.delenv(name, raising=False)
    # The default MLflow store sets MLFLOW_ALLOW_FILE_STORE for the process: gone again after these tests.
    env.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    env.delenv("MLFLOW_ALLOW_FILE_STORE")
    run_dir = tmp_path / "run"
    Trainer(_config(tmp_path, 2), devices=jax.devices()[:1]).fit(show_progress=False)
    first_ids = json.loads((run_dir / "trackers.json").read_text())
    config = _config(tmp_path, 4)
    result = Trainer(config, devices=jax.devices()[:1]).fit(show_progress=False)
  return config, run_dir, first_ids, result


def _losses(run_dir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_resume_continues_the_same_tracker_runs(resumed):
  _, run_dir, first_ids, result = resumed
  assert len(result.history) == 2  # steps 3 and 4: it resumed
  assert set(first_ids) == {"wandb", "mlflow"}
  assert json.loads((run_dir / "trackers.json").read_text()) == first_ids


def test_mlflow_holds_the_losses_and_the_config(resumed, tmp_path, monkeypatch):
  from mlflow.tracking import MlflowClient
  config, run_dir, ids, _ = resumed
  monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only so
  client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())  # the default store
  history = client.get_metric_history(ids["mlflow"], "train/loss")
  assert {m.step: m.value for m in history} == _losses(run_dir)
  assert sorted(m.step for m in history) == [1, 2, 3, 4]  # one run, each step once
  run = client.get_run(ids["mlflow"])
  assert run.info.status == "FINISHED" and run.info.run_name == "run"
  assert run.data.params["model.num_layers"] == "2"
  assert run.data.params["train.steps"] == "2"  # params are write-once: the first start's
  saved = Path(client.download_artifacts(ids["mlflow"], "config.yaml", str(tmp_path)))
  assert yaml.safe_load(saved.read_text()) == config.model_dump(mode="json")  # the latest start's


def _wandb_records(run_dir) -> list[dict]:
  """Every record of the run's offline .wandb logs (one per start), as wandb's own reader
  (`wandb leet inspect --json`) prints them."""
  records = []
  for log in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, check=True).stdout
    records += [json.loads(line) for line in out.splitlines() if line.strip()]
  return records


def test_wandb_holds_the_losses_and_the_config(resumed):
  config, run_dir, ids, _ = resumed
  logs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
  assert [log.name for log in logs] == [f"run-{ids['wandb']}.wandb"] * 2  # two starts, one run
  records = _wandb_records(run_dir)
  history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
  assert {step: item["train/loss"] for step, item in history.items()} == _losses(run_dir)
  starts = [r["run"] for r in records if r["type"] == "run"]
  assert [start["run_id"] for start in starts] == [ids["wandb"]] * 2
  assert starts[0]["project"] == "jaxpar" and starts[0]["display_name"] == "run"
  logged = {k: v for k, v in starts[-1]["config"]["update"].items() if k != "_wandb"}
  assert logged == config.model_dump(mode="json")  # the resumed start's config


def test_tensorboard_still_gets_every_step(resumed):
  _, run_dir, _, _ = resumed
  assert tensorboard_scalars(run_dir)["train/loss"] == pytest.approx(_losses(run_dir))


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_library_is_one_line_naming_the_extra(monkeypatch, name):
  monkeypatch.setitem(sys.modules, name, None)  # `import NAME` raises ImportError
  with pytest.raises(ConfigError) as error:
    check_installed(["tensorboard", name])
  assert str(error.value) == f"train.loggers includes {name}, which is not installed: pip install 'jaxpar[{name}]'"


def test_the_trainer_checks_before_building_anything(monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)
  with pytest.raises(ConfigError, match=r"pip install 'jaxpar\[wandb\]'"):
    Trainer(small_config(train={"loggers": ["wandb"]}))


def test_a_logger_named_twice_is_refused():
  with pytest.raises(ConfigError, match="wandb listed more than once"):
    small_config(train={"loggers": ["wandb", "tensorboard", "wandb"]})


def test_a_resume_may_change_the_loggers():
  from jaxpar.config import replace
  from jaxpar.train.resume import changed_keys
  config = small_config()
  assert changed_keys(config, replace(config, train={"loggers": ["mlflow"]})) == {}
