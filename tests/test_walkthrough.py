"""The README's commands, in the order it gives them, in a fresh folder, as a new user runs
them: each exits 0, none prints a traceback, and none silently does nothing (a training
command that finds its run already finished). Shortened where the README's form takes
minutes: training runs stop after 2 steps, TPU compiles and plans take one layer (and the
plan compiles one candidate).

Minutes in all, so it runs in .ci/run's second pass (the `long` marker), beside the pod
fits, not in the README's test command.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.long

ROOT = Path(__file__).parent.parent
# Commands that need what a fresh folder cannot hold, with the reason.
NEEDS_OUTSIDE_INPUT = {
    "convert hf-to-jaxpar": "a Hugging Face model folder (path/to/hf_model)",
    "data tokenize": "parquet shards and a tokenizer file of the user's",
    "--tasks hellaswag": "lm-eval's hellaswag download and a folder of task YAMLs",
}
SHORT_TRAINING = ["train.steps=2", "train.sample_tokens=8", "train.log_every=1"]


def readme_commands() -> list[str]:
  """Every `jaxpar` command of the README's bash blocks, in order (after `&&`, the last one)."""
  text = (ROOT / "README.md").read_text()
  commands = []
  for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    for line in block.splitlines():
      line = line.split("  #")[0].strip()
      line = line.split("&&")[-1].strip()
      if re.match(r"^(\w+=\S+ )*jaxpar\b", line):
        commands.append(line)
  return commands


def shortened(command: str) -> tuple[dict, list[str]]:
  """(environment variables, jaxpar's arguments) of a README command, in its shortened form."""
  words = shlex.split(command)
  env = dict(w.split("=", 1) for w in words[:words.index("jaxpar")])
  args = words[words.index("jaxpar") + 1:]
  if args[0] == "train" or args[:1] == ["launch-local"]:
    args += SHORT_TRAINING
  elif args[0] in ("compile", "plan"):
    args += ["model.num_layers=1"]
    if "--top" in args:  # the plan compiles one candidate, not three
      args[args.index("--top") + 1] = "1"
  return env, args


def _serve(args, cwd, env) -> tuple[int, str]:
  """`jaxpar serve ...` until /health answers at the address it announces, then SIGTERM: it
  drains and exits 0."""
  child = subprocess.Popen([sys.executable, "-m", "jaxpar", *args, "--port", "0"], cwd=cwd, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  output = []
  for line in child.stdout:
    output.append(line)
    found = re.search(r" on (http://\S+)/v1", line)
    if found:
      deadline = time.monotonic() + 60
      while time.monotonic() < deadline:
        try:
          with urllib.request.urlopen(f"{found[1]}/health", timeout=5) as reply:
            output.append(f"health {reply.status}\n")
            break
        except OSError:
          time.sleep(0.2)
      child.send_signal(signal.SIGTERM)
  return child.wait(timeout=120), "".join(output)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 20 minutes alone on 2 cores: past the suite's 1200 s bound
def test_the_readme_commands_run_in_order_in_a_fresh_folder(tmp_path):
  commands = readme_commands()
  assert commands[0] == "jaxpar train" and len(commands) >= 15, commands  # the README's main job first
  failures, ran = [], 0
  for command in commands:
    if any(part in command for part in NEEDS_OUTSIDE_INPUT):
      continue
    extra_env, args = shortened(command)
    env = {**os.environ, **extra_env}
    started = time.monotonic()
    if args[0] == "serve":
      code, output = _serve(args, tmp_path, env)
    else:
      run = subprocess.run([sys.executable, "-m", "jaxpar", *args], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=900)
      code, output = run.returncode, run.stdout + run.stderr
    ran += 1
    print(f"{time.monotonic() - started:6.1f} s  {command}")  # -s shows where the minutes go
    if code != 0 or "Traceback" in output or "already at step" in output:
      failures.append(f"{command}\n  exit {code}: {output.strip()[-1500:]}")
  assert not failures, "\n\n".join(failures)
  assert ran == len(commands) - len(NEEDS_OUTSIDE_INPUT), ran
