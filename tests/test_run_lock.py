"""One job per run directory: the lock names its holder, dies with its process, and is taken
before anything in the run directory is touched."""

import io
import json
import os
import socket
import subprocess
import sys

import jax
import pytest
from rich.console import Console

from jaxpar.cluster.run_lock import LOCK_NAME, RunLock
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config


def test_a_second_holder_is_refused_with_the_first_named(tmp_path):
  first = RunLock(tmp_path)
  assert first.acquire() is None
  holder = json.loads((tmp_path / LOCK_NAME).read_text())
  assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
  with pytest.raises(ValueError, match=rf"run directory {tmp_path} is in use by another job \(pid "
                                       rf"{os.getpid()} on host {socket.gethostname()}, started "):
    RunLock(tmp_path).acquire()
  first.release()
  assert not (tmp_path / LOCK_NAME).exists()
  again = RunLock(tmp_path)
  assert again.acquire() is None
  again.release()


def test_the_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path):
  # A process that wrote the lock file and died without removing it (kill -9, power loss).
  code = (f"from jaxpar.cluster.run_lock import RunLock; import os; RunLock({str(tmp_path)!r}).acquire(); "
          "print(os.getpid(), flush=True); os._exit(0)")
  dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
  assert dead.returncode == 0, dead.stderr
  dead_pid = int(dead.stdout)
  assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == dead_pid
  lock = RunLock(tmp_path)
  note = lock.acquire()
  assert note is not None and f"pid {dead_pid} on host {socket.gethostname()}" in note
  assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
  lock.release()


def test_fit_takes_the_lock_before_touching_checkpoints(tmp_path):
  config = small_config(model={"num_layers": 1}, mesh={"fsdp": 1}, tmp_path=tmp_path,
                        train={"peak_flops_per_device": 1e9})  # no matmul timing
  run_dir = tmp_path / "run"
  leftover = run_dir / "checkpoints" / "3.orbax-checkpoint-tmp"
  (leftover / "params").mkdir(parents=True)  # what a save killed half-way leaves
  output = io.StringIO()
  trainer = Trainer(config, devices=jax.devices()[:1], console=Console(file=output, width=200))
  other = RunLock(run_dir)
  other.acquire()
  with pytest.raises(ValueError, match="is in use by another job"):
    trainer.fit(show_progress=False)
  assert leftover.is_dir()  # the live job's save in progress is not cleaned away
  other.release()
  trainer.fit(steps=0, show_progress=False)  # starts (and cleans up), trains nothing
  assert not leftover.exists()
  assert f"removing the leftovers of an interrupted save in {run_dir / 'checkpoints'}: " \
         "3.orbax-checkpoint-tmp" in output.getvalue()
  assert not (run_dir / LOCK_NAME).exists()
