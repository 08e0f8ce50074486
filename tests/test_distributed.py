"""The multi-process pieces that need no second process: option checks, and the heartbeat and
stop-step protocols against an in-memory stand-in for the coordination service's key-value
store (tests/test_multiprocess.py runs them for real)."""

import threading
import time

import pytest

from jaxpar.cluster import distributed
from jaxpar.cluster.peers import PeerWatch
from jaxpar.cluster.preemption import Agreement

WAIT_S = 30  # bound on every wait here


class FakeStore:
  """The client calls jaxpar makes, on a dict (thread-safe, like the real client)."""

  def __init__(self):
    self.values, self.changed = {}, threading.Condition()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.changed:
      if key in self.values and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.values[key] = value
      self.changed.notify_all()

  def blocking_key_value_get(self, key, timeout_in_ms):
    with self.changed:
      if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]

  def key_value_dir_get(self, prefix):
    with self.changed:
      return [(k, v) for k, v in sorted(self.values.items()) if k.startswith(prefix)]


@pytest.mark.parametrize("options, message", [
    ({"coordinator": "10.0.0.2:8476"}, "--num-processes is missing (env JAX_NUM_PROCESSES)"),
    ({"coordinator": "10.0.0.2", "num_processes": 2, "process_id": 0}, "is not HOST:PORT"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, "--process-id=2 must be in 0..1"),
    ({"coordinator": "h:1", "num_processes": 2, "process_id": 0, "peer_timeout": 0}, "--peer-timeout=0 must be > 0"),
])
def test_options_are_checked_before_anything_starts(options, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    distributed.initialize(**options)
  assert not distributed.is_multiprocess()


def test_environment_fills_options_and_bad_values_name_the_variable(monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "h:1")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
    distributed.initialize()
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(ValueError, match="--process-id is missing"):
    distributed.initialize()


def test_no_options_and_no_cluster_is_one_process():
  assert distributed.initialize() is False
  assert not distributed.is_multiprocess() and distributed.label() == "" and distributed.coordination() is None


def _watches(store, n, timeout, failures):
  return [PeerWatch(store, i, n, timeout, on_failure=lambda m, i=i: failures.setdefault(i, m))
          for i in range(n)]


def _wait(condition):
  deadline = time.monotonic() + WAIT_S
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.02)
  return condition()


def test_a_silent_peer_is_named_and_a_finished_one_is_not():
  """Heartbeats driven by hand on a fake clock (no threads, no sleeps)."""
  store, failures = FakeStore(), {}
  watches = _watches(store, 3, 0.5, failures)
  for t in (0.0, 0.1, 0.2, 0.3, 0.4):
    for watch in watches:
      watch.beat(t)
  watches[2].stop()               # finished normally: nobody waits for it
  # Process 1 dies: no more heartbeats, no goodbye. Process 0 last saw its key change at
  # 0.5 (its beat of 0.4); quiet for the 0.5 s timeout is no failure yet, past it is.
  for t in (0.5, 0.6, 0.8, 1.0):
    watches[0].beat(t)
  assert not failures
  watches[0].beat(1.1)
  assert failures[0].startswith("process 1 stopped responding: no heartbeat for 0.5 s"), failures
  assert 2 not in failures and 1 not in failures


def test_a_failing_peer_reports_its_error_to_the_others():
  store, failures = FakeStore(), {}
  watches = _watches(store, 2, 30, failures)
  for watch in watches:
    watch.start()
  watches[1].stop(failed="ValueError: data.source='x' does not exist")
  assert _wait(lambda: 0 in failures)
  watches[0].stop()
  assert failures[0] == ("process 1 failed: ValueError: data.source='x' does not exist; the job stops: "
                         "restart all processes, they resume from the last complete checkpoint")


def _run_loops(agreements, start, steps, signal_at=None, stop_at_start=False):
  """Each agreement's loop in a thread, process 1 a step ahead; returns each one's last step."""
  last = {}

  def loop(i, agreement):
    agreement.begin(start)
    for step in range(start + 1, start + steps + 1):
      time.sleep(0.01 * (2 - i))
      last[i] = step
      if i == 1 and step == signal_at:
        agreement.notice("SIGTERM")
      if agreement.check(step):
        break
    agreement.close()

  if stop_at_start:
    agreements[0].notice("SIGINT")
  threads = [threading.Thread(target=loop, args=(i, a)) for i, a in enumerate(agreements)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(WAIT_S)
  return last


def _agreements(n=2):
  store = FakeStore()
  return [Agreement(store, i, n, timeout_s=WAIT_S, prefix="stop/") for i in range(n)]


def test_a_signal_on_one_process_stops_all_after_the_same_step():
  agreements = _agreements()
  last = _run_loops(agreements, start=10, steps=200, signal_at=15)
  assert last[0] == last[1] and 15 < last[0] < 210, last
  assert agreements[0].why == agreements[1].why == "SIGTERM on process 1"


def test_a_notice_before_the_first_step_stops_after_it():
  last = _run_loops(_agreements(), start=40, steps=50, stop_at_start=True)
  assert last == {0: 41, 1: 41}


def test_a_notice_after_a_process_finished_lets_the_others_finish():
  agreements = _agreements()
  agreements[0].begin(5)
  agreements[0].close()                 # process 0 is done after step 5
  agreements[1].begin(4)
  agreements[1].notice("SIGTERM")       # process 1, one step behind, is signalled now
  assert _wait(lambda: agreements[1].stop_after is not None)
  assert agreements[1].check(5) is None  # it still reaches step 5, where process 0 is
  assert agreements[1].stop_after == 6
  agreements[1].close()
