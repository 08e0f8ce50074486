"""A real multi-process job on this machine, started as a user would: `jaxpar launch-local 2`
(2 processes x 4 simulated CPU devices, gloo collectives, a coordinator on 127.0.0.1) training
one 8-device FSDP mesh.

Process starts are expensive here, so one run directory lives through one story:
  1. process 1 is killed (-9) mid-run: process 0 stops within --peer-timeout, naming it;
  2. the same command takes over the dead job's lock and resumes from the last complete
     checkpoint; SIGTERM to process 1 before its first step: both stop after the same step,
     save, exit 0;
  3. the same command resumes to the end, while a second job on the run dir is refused.
Then every step's loss must equal the one-process run, and the checkpoints must restore
across process counts. Every wait is bounded.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import replace, to_yaml
from jaxpar.cluster.launch_local import free_port
from jaxpar.train.trainer import Trainer
from tests.helpers import Job, small_config

pytestmark = pytest.mark.long  # three multi-process starts: minutes

ROOT = Path(__file__).parent.parent
STEPS = 16
PEER_TIMEOUT = 5
WAIT_S = 300  # bound on any wait for a process (tests.helpers.Job's too)


def _config(tmp_path):
  return small_config(
      mesh={"fsdp": 8}, data={"seq_len": 32, "global_batch_size": 16}, tmp_path=tmp_path,
      train={"steps": STEPS, "log_every": 1, "sample_tokens": 0, "peak_flops_per_device": 1e9},
      checkpoint={"every_steps": 2, "keep_last": None})


def _complete_steps(directory: Path) -> list[int]:
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def story(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("multiprocess")
  config = _config(tmp_path)
  config_file = tmp_path / "config.yaml"
  config_file.write_text(to_yaml(config))
  run_dir, seen, jobs = Path(config.train.run_dir), {}, []
  # The three starts compile the same programs: JAX's persistent cache spares two compiles.
  cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")}
  command = ["launch-local", "2", "--grace", "60", "--", "train", str(config_file), "--no-progress",
             "--peer-timeout", str(PEER_TIMEOUT)]
  try:
    # 1. kill -9 process 1 mid-run.
    job = Job(*command, env=cache)
    jobs.append(job)
    pids = job.pids()
    job.wait_for(r"^step +3 ")
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    seen["peer_error"] = job.wait_for(r"\[process 0\] error: .*", PEER_TIMEOUT + 60).group(0)
    seen["detect_s"] = time.monotonic() - killed
    seen["killed_code"] = job.finish()
    seen["killed_output"] = job.text
    seen["complete_after_kill"] = _complete_steps(run_dir / "checkpoints")

    # 2. the same command; SIGTERM to process 1 while it starts (restores, compiles).
    job = Job(*command, env=cache)
    jobs.append(job)
    pids = job.pids()
    seen["resumed_from"] = int(job.wait_for(r"resumed from step (\d+)").group(1))
    os.kill(pids[1], signal.SIGTERM)
    seen["preempted_code"] = job.finish()
    seen["preempted_output"] = job.text

    # 3. the same command to the end; meanwhile a second job on the same run dir. The first
    # job's processes are paused while the second runs, so they cannot finish before it
    # tries the lock (with the few steps left, on a loaded host they did); their peer
    # timeout outlasts the pause.
    job = Job(*command[:-1], str(WAIT_S), env=cache)
    jobs.append(job)
    pids = job.pids()
    seen["holder_pid"] = pids[0]
    job.wait_for(r"resumed from step")
    for pid in pids:
      os.kill(pid, signal.SIGSTOP)
    try:
      seen["second"] = subprocess.run([sys.executable, "-m", "jaxpar", "train", str(config_file), "--no-progress"],
                                      cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
    finally:
      for pid in pids:
        os.kill(pid, signal.SIGCONT)
    seen["final_code"] = job.finish()
    seen["final_output"] = job.text
  finally:
    for job in jobs:
      if job.process.poll() is None:
        job.kill_all()
  single = replace(config, train={"run_dir": str(tmp_path / "single")}, checkpoint={"enabled": False})
  seen["expected"] = [h["loss"] for h in Trainer(single).fit(show_progress=False).history]
  return config, run_dir, seen


@pytest.mark.slow
def test_a_killed_process_stops_the_others_naming_it(story):
  _, _, seen = story
  assert seen["killed_code"] != 0, seen["killed_output"][-3000:]
  assert seen["peer_error"].startswith(
      f"[process 0] error: process 1 stopped responding: no heartbeat for {PEER_TIMEOUT} s"), seen["peer_error"]
  assert "launch-local: process 1 was killed by SIGKILL" in seen["killed_output"]
  assert "Check failure stack trace" not in seen["killed_output"]  # ours came before JAX's abort
  print(f"process 0 stopped {seen['detect_s']:.1f} s after process 1 was killed")


@pytest.mark.slow
def test_restart_takes_over_the_lock_and_resumes_from_the_last_complete_checkpoint(story):
  _, _, seen = story
  assert seen["complete_after_kill"], "no checkpoint completed before the kill"
  assert seen["resumed_from"] == seen["complete_after_kill"][-1]
  assert re.search(r"took over the lock of a job that is gone \(pid \d+ on host", seen["preempted_output"])


@pytest.mark.slow
def test_sigterm_on_one_process_stops_all_after_the_same_step_with_one_checkpoint(story):
  _, run_dir, seen = story
  output = seen["preempted_output"]
  assert seen["preempted_code"] == 0, output[-3000:]
  stopped = int(re.search(r"stopped by SIGTERM on process 1 at step (\d+): checkpoint "
                          rf"saved in {run_dir}/checkpoints/\1;", output).group(1))
  assert seen["resumed_from"] < stopped < STEPS
  agreed = dict(re.findall(r"\[process (\d)\] WARNING jaxpar.train.trainer: SIGTERM on process 1: "
                           r"stopping after step (\d+), as all 2 processes do", output))
  assert agreed == {"0": str(stopped), "1": str(stopped)}, output[-3000:]
  assert f"resumed from step {stopped} " in seen["final_output"]


@pytest.mark.slow
def test_a_second_job_on_the_run_dir_is_refused_and_the_first_finishes(story):
  _, run_dir, seen = story
  second = seen["second"]
  assert second.returncode == 2
  lines = [line for line in second.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith(
      f"error: run directory {run_dir} is in use by another job (pid {seen['holder_pid']} on host "), second.stderr
  assert seen["final_code"] == 0, seen["final_output"][-3000:]
  assert f"checkpoint: {run_dir}/checkpoints/{STEPS}" in seen["final_output"]


@pytest.mark.slow
def test_losses_through_kill_preemption_and_resumes_equal_one_process(story):
  _, run_dir, seen = story
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  # Each step once: a resume drops what the killed and the stopped runs logged past their checkpoints.
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  assert [r["loss"] for r in records] == pytest.approx(seen["expected"], rel=1e-5)


def _numpy(state) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(state)}


@pytest.mark.slow
def test_checkpoints_restore_across_process_counts_and_meshes(story, tmp_path):
  config, run_dir, _ = story
  # Written by 2 processes on fsdp8; read by this one process on tensor 2 x fsdp 4.
  one = Trainer(replace(config, mesh={"fsdp": 4, "tensor": 2}))
  with Checkpointer(run_dir / "checkpoints", read_only=True) as checkpoints:
    state, data_state = checkpoints.restore(one.abstract_state().items(), STEPS)
  assert data_state == {"next_sample": STEPS * config.data.global_batch_size}
  values = _numpy(state)
  # Written by this one process; both read by 2 processes on data 2 x fsdp 4.
  with Checkpointer(tmp_path / "one", config.checkpoint) as checkpoints:
    checkpoints.save(STEPS, state, data_state=data_state, config=config, force=True)
  out = tmp_path / "seen.npz"
  two = replace(config, mesh={"data": 2, "fsdp": 4})
  job = Job("launch-local", "2", "--", sys.executable, str(ROOT / "tests" / "multiprocess_worker.py"),
            json.dumps(two.model_dump(mode="json")), str(out), str(run_dir / "checkpoints"), str(tmp_path / "one"))
  try:
    assert job.finish() == 0, job.text[-3000:]
  finally:
    job.kill_all()
  seen = dict(np.load(out))
  for i in range(2):
    assert int(seen.pop(f"{i}.next_sample")) == STEPS * config.data.global_batch_size
    got = {k[1:]: v for k, v in seen.items() if k.startswith(str(i))}
    assert sorted(got) == sorted(values)
    for key, want in values.items():
      np.testing.assert_array_equal(got[key], want, err_msg=f"checkpoint {i}: {key}")


@pytest.mark.slow
def test_peers_that_never_come_give_a_one_line_error():
  port = free_port()
  result = subprocess.run([sys.executable, "-m", "jaxpar", "train", "tiny", "--coordinator",
                           f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
                           "--init-timeout", "2"], cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines()[-1] == (
      f"[process 1] error: the job did not form within --init-timeout=2 s (coordinator 127.0.0.1:{port}, "
      "2 processes): start every process with the same --coordinator and --num-processes and its own "
      "--process-id, or raise --init-timeout")
