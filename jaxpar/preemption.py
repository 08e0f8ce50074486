"""SIGTERM (preemption) and SIGINT (Ctrl-C) become a request to stop after the current step."""

import contextlib
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
  """Set by a signal handler; the train loop checks it between steps."""

  def __init__(self):
    self.signal: str | None = None

  def __bool__(self) -> bool:
    return self.signal is not None


@contextlib.contextmanager
def stop_on_signals():
  """Yields a StopRequest. The first signal sets it and puts back the previous handlers, so a
  second signal acts at once (e.g. a second Ctrl-C interrupts a slow save)."""
  request = StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield request  # Python only delivers signals to the main thread
    return
  previous = {s: signal.getsignal(s) for s in SIGNALS}

  def restore_handlers():
    for s, handler in previous.items():
      signal.signal(s, handler)

  def handle(signum, _frame):
    request.signal = signal.Signals(signum).name
    restore_handlers()

  for s in SIGNALS:
    signal.signal(s, handle)
  try:
    yield request
  finally:
    restore_handlers()
