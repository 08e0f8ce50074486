"""Peer failure detection: a heartbeat through the key-value store of JAX's coordination service.

JAX's runtime notices a dead process too, but reports it by aborting every other process
with a C++ stack trace, and only after its heartbeat timeout. Here each process bumps its
own key ten times per timeout and reads everyone's; a peer whose key stops changing for
`timeout` seconds, or that reports its own failure, stops this process with one line naming
it. (When process 0 dies it takes the coordination service with it, and JAX's runtime
stops the others at once with its own message.)
"""

import threading
import time

_PREFIX = "jaxpar/peers/"


class PeerWatch:
  """Heartbeat of this process and watch over the others. A key reads `alive N`, `done` (the
  process finished normally: nobody waits for it) or `failed MESSAGE`."""

  def __init__(self, client, process_id: int, num_processes: int, timeout: float, *, on_failure):
    self.client, self.process_id, self.num_processes = client, process_id, num_processes
    self.timeout = float(timeout)
    # Each beat is two small RPCs to process 0; a reply lists every process. Ten beats per
    # timeout, at most one per 5 s, keeps that light on a pod of thousands of hosts.
    self.interval = min(self.timeout / 10, 5.0)
    self.on_failure = on_failure  # called with one line; expected not to return
    self._stopped = threading.Event()
    self._thread = threading.Thread(target=self._run, name="jaxpar-peer-watch", daemon=True)
    self._beats, self._last_reached = 0, None
    self._seen: dict[int, tuple[str, float]] = {}  # peer -> (its value, when it last changed)

  def start(self):
    if self.num_processes > 1:
      self._thread.start()

  def stop(self, failed: str | None = None):
    """Stop beating; tell the peers this process is done, or failed with `failed`."""
    if self._stopped.is_set():
      return
    self._stopped.set()
    if self.num_processes > 1:
      try:
        self._publish(f"failed {failed}" if failed else "done")
      except Exception:  # noqa: BLE001  the service may be gone already; the peers notice anyway
        pass

  def _publish(self, value: str):
    self.client.key_value_set(f"{_PREFIX}{self.process_id}", value, allow_overwrite=True)

  def _run(self):
    while not self._stopped.wait(self.interval):
      self.beat(time.monotonic())

  def beat(self, now: float):
    """One heartbeat at time `now` (seconds on a monotonic clock): bump this process's key,
    read everyone's, and stop the job over a peer that failed or went quiet."""
    if self._last_reached is None:
      self._last_reached = now
    try:
      self._beats += 1
      self._publish(f"alive {self._beats}")
      values = dict(self.client.key_value_dir_get(_PREFIX))
      self._last_reached = now
    except Exception as e:  # noqa: BLE001  any RPC error: retry until the timeout
      if now - self._last_reached > self.timeout and not self._stopped.is_set():
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        self.on_failure(f"lost the coordination service (on process 0) for {self.timeout:g} s "
                        f"({first}); the job stops: restart all processes")
      return
    problem = self._check(values, self._seen, now)
    if problem and not self._stopped.is_set():
      self.on_failure(f"{problem}; the job stops: restart all processes, they resume from "
                      "the last complete checkpoint")

  def _check(self, values: dict, seen: dict, now: float) -> str | None:
    for peer in range(self.num_processes):
      if peer == self.process_id:
        continue
      value = values.get(f"{_PREFIX}{peer}", "")
      if value.startswith("failed"):
        return f"process {peer} failed: {value.removeprefix('failed ')}"
      if value == "done":
        continue
      if peer not in seen or seen[peer][0] != value:
        seen[peer] = (value, now)
      elif now - seen[peer][1] > self.timeout:
        return (f"process {peer} stopped responding: no heartbeat for {self.timeout:g} s "
                "(--peer-timeout); it died or hangs")
    return None
