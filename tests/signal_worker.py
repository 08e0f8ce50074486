"""A stand-in for a training process under `jaxpar launch-local` (tests/test_signals.py):
the loop `Trainer.fit` runs, without a model. It counts steps until jaxpar's
`stop_on_signals` says stop, then "saves" for SAVE_S seconds and exits 0.

    python tests/signal_worker.py SAVE_S
"""

import os
import sys
import time

from jaxpar.cluster.preemption import stop_on_signals


def say(text: str):
  # One write per line: the two workers share the launcher's output, and print's separate
  # writes of text and newline interleaved ("step 3step 3"), hiding the line a test waits for.
  os.write(1, f"{text}\n".encode())


with stop_on_signals() as stop:
  stop.begin(0)
  step = 0
  while not stop.check(step):
    step += 1
    say(f"step {step}")
    time.sleep(0.05)
  say(f"stopped by {stop.signal} after step {step}")
  time.sleep(float(sys.argv[1]))
say("saved")
