"""A stand-in for a training process under `jaxpar launch-local` (tests/test_signals.py):
the loop `Trainer.fit` runs, without a model. It counts steps until jaxpar's
`stop_on_signals` says stop, then "saves" for SAVE_S seconds and exits 0.

    python tests/signal_worker.py SAVE_S
"""

import sys
import time

from jaxpar.cluster.preemption import stop_on_signals

with stop_on_signals() as stop:
  stop.begin(0)
  step = 0
  while not stop.check(step):
    step += 1
    print(f"step {step}", flush=True)
    time.sleep(0.05)
  print(f"stopped by {stop.signal} after step {step}", flush=True)
  time.sleep(float(sys.argv[1]))
print("saved", flush=True)
