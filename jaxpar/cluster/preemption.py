"""SIGTERM (preemption) and SIGINT (Ctrl-C) become a request to stop after a step.

One process: the first signal sets the request; the loop stops after the current step.
Several processes must stop after the *same* step, or the ones still training block in a
collective. There a signal on any process posts a notice in the key-value store of JAX's
coordination service. A watcher thread in every process sees it at once, posts the last
step its loop checked, and waits for every process's post; all stop after the largest + 1
(the step each may already have dispatched). Meanwhile a process's loop waits at `check`, so
no process runs past the agreed step; a notice during the restore stops after the first step. (The same protocol as JAX's own
preemption service, which jaxpar turns off: that one misses a notice that arrives before
the first step of a resumed run, and knows neither Ctrl-C nor which process was signalled.)
"""

import contextlib
import itertools
import logging
import signal
import threading
import time

from jaxpar.cluster import distributed

_log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Signals this close together are one request: `timeout` signals its child and then the
# child's process group, `scancel` and systemd every process of a job, a launcher forwards.
SAME_SIGNAL_S = 2.0
_fits = itertools.count()  # one key-value namespace per stop_on_signals (same on every process)


class StopRequest:
  """Checked by the train loop after each step: `check(step)` says whether to stop there."""

  def __init__(self, agreement=None):
    self.agreement = agreement
    self.signal: str | None = None  # e.g. "SIGTERM", or "SIGTERM on process 1" (several processes)

  @property
  def agreed(self) -> bool:
    return self.agreement is not None

  def __bool__(self) -> bool:
    return self.signal is not None

  def check(self, step: int) -> bool:
    if self.agreement is not None and self.signal is None:
      self.signal = self.agreement.check(step)
    return bool(self)

  def notice(self, name: str):
    if self.agreement is not None:
      self.agreement.notice(name)
    else:
      self.signal = name

  def begin(self, start_step: int):
    """The loop starts after `start_step` (a notice before this waits for it)."""
    if self.agreement is not None:
      self.agreement.begin(start_step)


class Agreement:
  """The stop step of a multi-process job (see the module doc)."""

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float, prefix: str):
    self.client, self.process_id, self.num_processes = client, process_id, num_processes
    self.prefix = prefix  # its keys in the store: the same on every process, new for each run
    self.timeout_s = timeout_s
    self.lock = threading.Lock()  # held by the watcher from its post until the stop step is known
    self.checked = 0              # the last step the loop checked (or started after)
    self.begun = threading.Event()
    self.noticed = threading.Event()  # the watcher saw a notice ...
    self.agreed = threading.Event()   # ... and the stop step is known (or could not be agreed)
    self.posted = False
    self.stop_after: int | None = None
    self.why: str | None = None
    self.closed = threading.Event()
    self.watcher = threading.Thread(target=self._watch, name="jaxpar-stop-watch", daemon=True)
    self.watcher.start()

  def notice(self, name: str):
    try:
      self.client.key_value_set(f"{self.prefix}notice", f"{name} on process {self.process_id}")
    except Exception:  # noqa: BLE001  another process posted first: one notice is enough
      pass

  def begin(self, start_step: int):
    with self.lock:
      self.checked = start_step
    self.begun.set()

  def check(self, step: int) -> str | None:
    if self.noticed.is_set():  # a stop step is being agreed: know it before going on
      self.agreed.wait(self.timeout_s + 10)
    with self.lock:
      self.checked = step
      if self.stop_after is not None and step >= self.stop_after:
        return self.why
      return None

  def close(self):
    """The loop is over: stand in for this process with its last step, so a late notice on
    another process agrees on a step this one reached."""
    self.closed.set()
    self.begun.set()
    self.agreed.set()
    with self.lock:
      try:
        self._post()
      except Exception:  # noqa: BLE001  the service is gone: peers.py reports why
        pass
    self.watcher.join(timeout=5)

  def _post(self):
    if not self.posted:
      self.posted = True
      self.client.key_value_set(f"{self.prefix}step/{self.process_id}", str(self.checked))

  def _watch(self):
    why = None
    while why is None and not self.closed.is_set():
      try:
        why = self.client.blocking_key_value_get(f"{self.prefix}notice", 1000)
      except Exception:  # noqa: BLE001  not yet (deadline), or the service is gone (peers.py reports)
        self.closed.wait(0.05)
    if why is None:
      return
    self.noticed.set()
    self.begun.wait()  # a notice during the restore: the loop's first step is known only then
    with self.lock:
      if not self.closed.is_set():
        self._post()
        self.stop_after, self.why = self._agree(why)
    self.agreed.set()

  def _agree(self, why: str) -> tuple[int | None, str | None]:
    deadline = time.monotonic() + self.timeout_s
    while time.monotonic() < deadline:
      posts = self.client.key_value_dir_get(f"{self.prefix}step/")
      if len(posts) == self.num_processes:
        return max(int(value) for _, value in posts) + 1, why
      time.sleep(0.05)
    _log.error("%s, but the processes did not agree on a step to stop after within %g s: "
               "training goes on", why, self.timeout_s)
    return None, None


@contextlib.contextmanager
def stop_on_signals():
  """Yields a StopRequest; call its `begin(start_step)` before the loop. The first signal
  sets it (several processes: posts the notice). Signals within SAME_SIGNAL_S of it are the
  same stop delivered again (a supervisor signals every process of a job, and a launcher
  passes it on too); a later one puts back the previous handlers and acts at once (e.g. a
  second Ctrl-C interrupts a slow save)."""
  job = distributed.coordination()
  request = StopRequest(None if job is None else Agreement(
      *job[:3], timeout_s=2 * job[3], prefix=f"jaxpar/stop/{next(_fits)}/"))
  try:
    with _handlers(request):
      yield request
  finally:
    if request.agreement is not None:
      request.agreement.close()


@contextlib.contextmanager
def _handlers(request: StopRequest):
  if threading.current_thread() is not threading.main_thread():
    yield  # Python only delivers signals to the main thread
    return
  previous = {s: signal.getsignal(s) for s in SIGNALS}

  def restore_handlers():
    for s, handler in previous.items():
      signal.signal(s, handler)

  first = []

  def handle(signum, _frame):
    now = time.monotonic()
    if not first:
      first.append(now)
      request.notice(signal.Signals(signum).name)
    elif now - first[0] > SAME_SIGNAL_S:
      restore_handlers()
      signal.raise_signal(signum)

  for s in SIGNALS:
    signal.signal(s, handle)
  try:
    yield
  finally:
    restore_handlers()
