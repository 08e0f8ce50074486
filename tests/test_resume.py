"""A run directory holds one run: `jaxpar train` resumes it when only safe keys changed,
refuses other changes in one line before touching it, says when it is already finished, and
`--overwrite` replaces it (jaxpar/train/resume.py)."""

import json
import re

from jaxpar.checkpoint import Checkpointer
from jaxpar.cli import main
from jaxpar.config import CheckpointConfig
from jaxpar.weights import SavedRun

RUN = ["tiny", "--no-progress", "data.global_batch_size=8", "train.log_every=0", "train.sample_tokens=0"]


def _train(capsys, run_dir, *overrides):
  code = main(["train", *RUN, f"train.run_dir={run_dir}", *overrides])
  out, err = capsys.readouterr()
  return code, out, err.strip()


def _steps(run_dir):
  return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_resumes_on_safe_changes_and_refuses_others(tmp_path, capsys):
  run_dir = tmp_path / "run"
  assert _train(capsys, run_dir, "train.steps=2")[0] == 0

  # Another batch size: refused in one line naming the key and both ways out; nothing written.
  code, out, err = _train(capsys, run_dir, "train.steps=4", "data.global_batch_size=16")
  assert code == 2 and len(err.splitlines()) == 1, err
  assert "data.global_batch_size: 8 saved, 16 now" in err and "train.run_dir=" in err and "--overwrite" in err
  assert Checkpointer(run_dir / "checkpoints", CheckpointConfig()).latest_step() == 2 and _steps(run_dir) == [1, 2]

  # Adapters over a base where a full model was trained: refused the same way.
  code, out, err = _train(capsys, run_dir, "train.steps=4", f"model.lora.base={run_dir}")
  assert code == 2 and "model.lora: None saved" in err, err
  trained, share = re.search(r"parameters \(trainable ([\d,]+), ([\d.]+)%\)", out).groups()
  total = int(re.search(r"train: ([\d,]+) parameters", out)[1].replace(",", ""))
  assert 0 < int(trained.replace(",", "")) < total and float(share) == round(100 * int(trained.replace(",", "")) / total, 2)

  # A finished run says so and how to go on, and trains nothing.
  code, out, _ = _train(capsys, run_dir, "train.steps=2")
  assert code == 0 and "is already at step 2 of train.steps=2: nothing to train" in out, out
  assert "--overwrite" in out and "done" not in out and _steps(run_dir) == [1, 2]

  # More steps and other logging: the same run, resumed.
  code, out, err = _train(capsys, run_dir, "train.steps=3", "train.log_every=1")
  assert code == 0 and "resumed from step 2" in out, (out, err)
  assert _steps(run_dir) == [1, 2, 3]


def test_overwrite_replaces_the_saved_run(tmp_path, capsys):
  run_dir = tmp_path / "run"
  assert _train(capsys, run_dir, "train.steps=3")[0] == 0
  code, out, err = _train(capsys, run_dir, "train.steps=2", "data.global_batch_size=16", "--overwrite")
  assert code == 0, err
  assert "--overwrite: removed" in out and "resumed" not in out, out
  assert _steps(run_dir) == [1, 2]  # the old run's records went with it
  with SavedRun(run_dir) as saved:
    assert saved.step == 2 and saved.config.data.global_batch_size == 16


def test_a_resume_keeps_each_step_once_in_the_records(tmp_path):
  """An interrupted start logged steps 4-5 past its step-3 checkpoint (the last line cut by
  the kill); the resume trains them again: metrics.jsonl and TensorBoard hold each step once,
  with the resumed values. A start that trains nothing adds no TensorBoard file."""
  from jaxpar.train.metrics import MetricsLogger
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  first = MetricsLogger(tmp_path, 5, show_progress=False)
  for step in range(1, 6):
    first.log(step, {"loss": float(step)})
  first.close()
  with open(tmp_path / "metrics.jsonl", "a") as jsonl:
    jsonl.write('{"step": 6, "lo')
  resumed = MetricsLogger(tmp_path, 6, start_step=3, show_progress=False)
  for step in range(4, 7):
    resumed.log(step, {"loss": 10.0 + step})
  resumed.close()
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["loss"]) for r in records] == [(1, 1), (2, 2), (3, 3), (4, 14), (5, 15), (6, 16)]
  events = EventAccumulator(str(tmp_path / "tensorboard"))  # as TensorBoard reads them
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1), (2, 2), (3, 3), (4, 14), (5, 15), (6, 16)]
  files = sorted((tmp_path / "tensorboard").iterdir())
  MetricsLogger(tmp_path, 6, start_step=6, show_progress=False).close()
  assert sorted((tmp_path / "tensorboard").iterdir()) == files
