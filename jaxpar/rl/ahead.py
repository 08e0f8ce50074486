"""Off-policy rollouts (objective.max_staleness = k >= 1, on rollout devices of their own):
a thread draws rollout batches on the rollout devices while the trainer trains on the
others, up to k batches ahead, always from the newest weights it has been handed.

A batch drawn from the weights after update v and trained on at update t + 1 is t - v
updates stale (the `staleness` metric); one staler than k is dropped and the next taken.
The loss's ratio is against the log-probabilities recorded when the batch was drawn, so
it corrects for the drift (importance sampling, clipped). The weights are copied to the
rollout devices as soon as the trainer hands them over, before its next update donates
them. Resuming draws fresh rollouts: the batches queued at the stop are not replayed.
"""

import queue
import threading
import time

import jax

from jaxpar.inference.engine import bytes_to_move
from jaxpar.objectives.base import policy_weights


class AheadRollouts:
  def __init__(self, rollouts, max_staleness: int):
    self.rollouts, self.max_staleness = rollouts, max_staleness
    self._ready: queue.Queue = queue.Queue(maxsize=max_staleness)
    self._newest = None  # (weights on the rollout devices, the update they are after)
    self._handed = threading.Condition()
    self._thread = None
    self._stopping = False
    self._step = 0
    self._metrics: dict = {}
    self._copy: dict = {}  # the last hand-over's time and bytes

  def follow(self, state):
    self._step = int(state.step)
    weights = (self.rollouts.changing(policy_weights(state.params, state.frozen)), state.model_state)
    if self._thread is None:  # the first weights build the engine, here, before the thread starts
      self.rollouts.follow(state)
      self.rollouts._sync()
      self._thread = threading.Thread(target=self._draw, name="jaxpar-rollouts", daemon=True)
      self._thread.start()
    wanted = self.rollouts.engine.programs.state_shardings
    started = time.perf_counter()
    moving = bytes_to_move(weights, wanted)
    copied = jax.device_put(weights, wanted)  # before the next update donates them
    self._copy = {"sync_s": time.perf_counter() - started, "sync_bytes": float(moving)}
    with self._handed:
      self._newest = (copied, self._step)
      self._handed.notify()

  def _draw(self):
    rollouts, used = self.rollouts, None
    try:
      while not self._stopping:
        with self._handed:
          self._handed.wait_for(lambda: self._newest is not None or self._stopping)
          if self._stopping:
            return
          weights, version = self._newest
        if version != used:
          rollouts._weights, rollouts._step = weights, version
          used = version
        batch, metrics = rollouts._rollout()
        self._ready.put((batch, metrics, version))
    except BaseException as e:  # the trainer raises it at its next batch
      self._ready.put(e)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    started = time.perf_counter()
    while True:
      item = self._ready.get()
      if isinstance(item, BaseException):
        raise item
      batch, metrics, version = item
      if self._step - version <= self.max_staleness:
        break
    self._metrics = {**metrics, **self._copy, "staleness": float(self._step - version),
                     "rollout_wait_s": time.perf_counter() - started}
    return batch

  def host_metrics(self) -> dict:
    return self._metrics

  def finish(self, state) -> dict:
    """End of the run: stop the thread (the batches it drew ahead are dropped)."""
    with self._handed:
      self._stopping = True
      self._handed.notify()
    while self._thread is not None and self._thread.is_alive():
      try:
        self._ready.get(timeout=0.1)  # frees a put it may be blocked in
      except queue.Empty:
        pass
    return {}

  def get_state(self) -> dict:
    return self.rollouts.get_state()

  def set_state(self, state: dict):
    self.rollouts.set_state(state)
