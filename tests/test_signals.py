"""How a multi-process job stops when schedulers stop it: `timeout` signals the launcher
twice at once (directly and through its process group), `scancel` and systemd signal every
process of the job. Signals that close together are one stop: every process stops, "saves"
and exits 0, and nothing is killed. A signal that comes later still kills (a second Ctrl-C).
The processes are tests/signal_worker.py under the real `jaxpar launch-local`."""

import os
import signal
import sys
import time
from pathlib import Path

from jaxpar.cluster.preemption import SAME_SIGNAL_S
from tests.helpers import Job

WORKER = str(Path(__file__).parent / "signal_worker.py")


def _running(save_s: float, wrapper=()) -> tuple[Job, list[int]]:
  """The launcher (under `wrapper`) and its two workers' pids, once both count steps."""
  job = Job("launch-local", "2", "--", sys.executable, WORKER, str(save_s), wrapper=wrapper)
  pids = job.pids()
  job.wait_for(r"^step 3$")
  return job, pids


def _stopped_cleanly(job: Job):
  code = job.finish()
  assert code == 0, job.text[-3000:]
  assert job.text.count("sending SIGTERM") == 1 and "SIGKILL" not in job.text, job.text[-3000:]
  assert job.text.count("stopped by SIGTERM after step") == 2 and job.text.count("saved") == 2, job.text[-3000:]


def test_timeout_stops_the_job_once_and_nothing_is_killed():
  job, _ = _running(save_s=1, wrapper=("timeout", "600"))
  try:
    os.kill(job.process.pid, signal.SIGTERM)  # timeout passes it to the launcher, then to its group
    _stopped_cleanly(job)
  finally:
    job.kill_all()


def test_a_signal_to_every_process_of_the_job_is_one_stop():
  job, pids = _running(save_s=1)
  try:
    for pid in [job.process.pid, *pids]:  # as scancel does: launcher and workers, at once
      os.kill(pid, signal.SIGTERM)
    _stopped_cleanly(job)
  finally:
    job.kill_all()


def test_a_later_signal_still_kills():
  job, _ = _running(save_s=60)  # a save that would outlast the user's patience
  try:
    os.kill(job.process.pid, signal.SIGTERM)
    job.wait_for(r"stopped by SIGTERM")
    time.sleep(SAME_SIGNAL_S + 0.5)
    os.kill(job.process.pid, signal.SIGTERM)
    code = job.finish()
    assert "launch-local: SIGTERM again: sending SIGKILL to the processes" in job.text, job.text[-3000:]
    assert code == 128 + signal.SIGKILL and "saved" not in job.text, (code, job.text[-3000:])
  finally:
    job.kill_all()
