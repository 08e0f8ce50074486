"""XLA's C++ log lines that a user cannot act on, dropped from stderr while a block runs.

`jaxpar plan` compiles layouts it chose itself; when one of them makes the SPMD partitioner
reshard a tensor the slow way, XLA logs `Involuntary full rematerialization` straight to
file descriptor 2, where no Python logging filter sees it. The planner's own ranking
already prices that layout; the user has nothing to change. Every other line passes.
"""

import contextlib
import os
import sys
import threading

NOT_ACTIONABLE = (b"Involuntary full rematerialization",)


@contextlib.contextmanager
def drop_xla_lines(markers=NOT_ACTIONABLE):
  """Route file descriptor 2 through a filter while the block runs: lines holding one of
  `markers` (bytes) are dropped, the others passed on as they come."""
  sys.stderr.flush()
  original = os.dup(2)
  read, write = os.pipe()
  os.dup2(write, 2)
  os.close(write)

  def pump():
    with os.fdopen(read, "rb") as pipe:
      for line in pipe:
        if not any(marker in line for marker in markers):
          os.write(original, line)

  thread = threading.Thread(target=pump, daemon=True)
  thread.start()
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(original, 2)  # closes the pipe's last write end: the pump reads to the end and stops
    thread.join()
    os.close(original)
