"""The front door as a new user meets it: the public API, options anywhere on the command
line, a clean first screen, the resume message and honest step times."""

import json
import os
import subprocess
import sys

import jaxpar

TINY_RUN = ["data.global_batch_size=8", "train.log_every=1", "train.sample_tokens=0"]


def _jaxpar(*args, env=None):
  return subprocess.run([sys.executable, "-m", "jaxpar", *args], capture_output=True, text=True,
                        timeout=300, env=env)


def test_public_api_names():
  config = jaxpar.load_config("tiny", ["train.steps=7"])
  assert config.train.steps == 7 and isinstance(config, jaxpar.Config)
  assert jaxpar.Trainer.__name__ == "Trainer" and jaxpar.Runtime.__name__ == "Runtime"


def test_options_after_overrides_first_screen_resume_and_step_times(tmp_path):
  run = f"train.run_dir={tmp_path}/run"
  # No JAX_PLATFORMS: the CLI itself must keep libtpu quiet on a host without TPUs.
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  first = _jaxpar("train", "tiny", "--no-progress", *TINY_RUN, "train.steps=8", run, env=env)
  assert first.returncode == 0, first.stderr[-2000:]
  assert "libtpu" not in first.stderr and "TPU" not in first.stderr, first.stderr
  assert first.stdout.startswith("jaxpar train:"), first.stdout[:500]
  assert "resumed" not in first.stdout
  again = _jaxpar("train", "tiny", *TINY_RUN, "train.steps=10", run, "--no-progress", env=env)
  assert again.returncode == 0, again.stderr[-2000:]
  assert f"resumed from step 8 ({tmp_path}/run/checkpoints/8)" in again.stdout
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(1, 11))
  # The first step after each start has no time (it compiles); every other one has one
  # (test_train.py checks with a fake clock that each is the gap between completions).
  assert "step_time_s" not in records[0] and "step_time_s" not in records[8]
  assert sum("step_time_s" in r for r in records) == 8


def test_unknown_option_is_still_an_error():
  result = _jaxpar("train", "tiny", "train.steps=1", "--no-such-flag")
  assert result.returncode == 2 and "unrecognized arguments: --no-such-flag" in result.stderr


def test_a_user_mistake_is_one_line_and_exit_2(capsys):
  from jaxpar.cli import main
  assert main(["config", "show", "tiny", "model.num_heads=3"]) == 2
  err = capsys.readouterr().err.strip()
  assert err == "error: model.num_kv_heads=2 must divide model.num_heads=3", err


def test_a_bug_says_so_with_a_short_traceback_and_exit_1(monkeypatch, capsys):
  """A ValueError from deep inside (JAX, or a bug of ours) is not a user's mistake."""
  import pytest

  import jaxpar.config
  from jaxpar.cli import main

  def broken(*args, **kwargs):
    raise ValueError("shapes (3,) and (4,) do not broadcast")
  monkeypatch.setattr(jaxpar.config, "load_config", broken)
  assert main(["config", "show", "tiny"]) == 1
  err = capsys.readouterr().err
  assert "ValueError: shapes (3,) and (4,) do not broadcast" in err
  assert "this is a bug in jaxpar; run again with --debug for the full traceback" in err
  assert "in broken" in err  # the frame that raised
  with pytest.raises(ValueError, match="do not broadcast"):  # --debug anywhere: the real traceback
    main(["config", "show", "tiny", "--debug"])


def test_version_and_no_abbreviated_options(capsys):
  import pytest

  from jaxpar.cli import main
  with pytest.raises(SystemExit) as done:
    main(["--version"])
  assert done.value.code == 0 and capsys.readouterr().out.startswith("jaxpar 0.")
  with pytest.raises(SystemExit) as done:  # --restor is not --restore, and train's usage says so
    main(["train", "tiny", "--restor", "runs/x"])
  err = capsys.readouterr().err
  assert done.value.code == 2 and "unrecognized arguments: --restor: did you mean '--restore'?" in err, err
  assert err.startswith("usage: jaxpar train"), err


def test_mistyped_commands_and_keys_get_the_nearest_suggested(capsys):
  import pytest

  from jaxpar.cli import main
  with pytest.raises(SystemExit) as done:
    main(["trian"])
  last = capsys.readouterr().err.splitlines()[-1]
  assert done.value.code == 2 and "invalid choice: 'trian'" in last and last.endswith("did you mean 'train'?")
  for key, hint in [("train.stepz", "did you mean 'train.steps'?"), ("trian.steps", "did you mean 'train'?"),
                    ("model.num_layerz", "did you mean 'model.num_layers'?"), ("model.qqq", "check the spelling")]:
    assert main(["config", "show", "tiny", f"{key}=3"]) == 2
    assert f"unknown config key '{key.split('.')[0] if key.startswith('trian') else key}': {hint}" in capsys.readouterr().err


def test_compile_without_a_topology_is_a_user_error(capsys):
  from jaxpar.cli import main
  assert main(["compile", "tiny"]) == 2
  assert "no TPU topology: pass --topology" in capsys.readouterr().err
