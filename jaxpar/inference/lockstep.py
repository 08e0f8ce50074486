"""Serving from several processes in lock step (`jaxpar launch-local 2 -- serve RUN mesh.tensor=8`,
or one process per host of a pod): one engine whose weights and KV pages are sharded over
every process's devices.

Every process builds the same engines from the same command line and compiles the same
programs. Process 0 then serves HTTP, tokenizes and schedules; the others only repeat its
device calls. Every engine program call on process 0 (a prompt chunk, a decode step, a
speculative round, with its tokens, positions, page table, slots, adapters and sampling
settings as host arrays) is first published as message n; every other process reads message
n, runs the same compiled program on its own shards and keeps the cache it returns. The
sampled tokens come back to process 0 as the program's outputs, which are replicated over
the processes (`Programs` compiles them so when there are several), so process 0 reads them
as one process does. An argument that is an output of an engine's latest call (a decode
step's tokens fed to the next step before the host reads them: the engine's run-ahead) goes
as a reference to that output, which every process holds, so process 0 never waits for it.

The transport is JAX's own coordination service (its key-value store, which `jax.distributed`
runs anyway and the peer heartbeat already uses): the messages are small (a few arrays of
slots x chunk integers), one per device call, and nothing else needs installing or a port
opening. Every FLOW_WINDOW messages process 0 waits until every process has run the ones a
window before, then deletes those: the store holds at most two windows, and a process that
falls behind holds the server back by at most one.

Faults: a process that dies or hangs stops the job within --peer-timeout (`peers.PeerWatch`;
the collective it left waits no longer than that), process 0 exits non-zero and its clients'
connections end with an error. An engine failure on process 0 also ends the job: the others
may be inside the program that failed. SIGTERM (passed to every process by the launcher)
drains process 0's server; then it publishes STOP and every process exits 0.
"""

import pickle
import sys
from typing import NamedTuple

import jax
import numpy as np

from jaxpar.cluster import distributed
from jaxpar.errors import ConfigError

FLOW_WINDOW = 128  # messages between process 0's checks that every process keeps up
_PREFIX = "jaxpar/lockstep/"
_STOP = "stop"
_WAIT_MS = 10_000  # a follower's wait for the next message, renewed while the server is idle


def engines_of(engine) -> list:
  """The engines whose programs run in lock step: the served one and its draft model's."""
  draft = getattr(engine.draft, "engine", None)
  return [engine] + ([draft] if draft is not None else [])


def check_servable(replicas: int, prefill_devices: int | None):
  """One-line errors for what lock-step serving does not do, before any request."""
  if replicas != 1 or prefill_devices:
    raise ConfigError("--replicas or --prefill-devices with several processes: those are engines of one process; "
                      "serve one engine over all the processes' devices, or run one server per host")


class Output(NamedTuple):
  """An argument that is output `index` of engine `engine`'s latest program call."""
  engine: int
  index: int


class Lockstep:
  """Process 0's publisher, or another process's follower, of the engines' program calls."""

  def __init__(self, engine, coordination=None):
    """coordination: (key-value client, process id, processes, peer timeout in seconds);
    default: this job's (`distributed.coordination`)."""
    found = coordination or distributed.coordination()
    if found is None:
      raise ConfigError("lock-step serving needs a multi-process job: start it with jaxpar launch-local N -- "
                        "serve ... (or the cluster's launcher)")
    self.client, self.process_id, self.num_processes, self.timeout_s = found
    self.engines = engines_of(engine)
    self.sent = 0
    self._last = {}  # engine index -> the outputs of its latest call
    if self.process_id == 0:
      for e in self.engines:
        e.lockstep = self

  # -- process 0 ----------------------------------------------------------------------

  def publish(self, engine, kind: str, rows):
    """Message `sent`: run program `kind` of `engine` with these per-row arguments."""
    host = [self._encode(x) for x in rows]
    # pickle: the payload never leaves the job (the same service carries the job's own state).
    self._send(pickle.dumps((self.engines.index(engine), kind, host), protocol=pickle.HIGHEST_PROTOCOL))

  def returned(self, engine, outputs):
    """The outputs of `engine`'s call just run (every process keeps its own)."""
    self._last[self.engines.index(engine)] = outputs if isinstance(outputs, tuple) else (outputs,)

  def _encode(self, x):
    """A reference to an output of a latest call, else the argument as numpy."""
    if isinstance(x, jax.Array):
      for engine, outputs in self._last.items():
        for index, output in enumerate(outputs):
          if output is x:
            return Output(engine, index)
    return _to_host(x)

  def finish(self):
    """Every process stops following (after process 0's server has drained)."""
    self._send(_STOP.encode())

  def failed(self, error: Exception):
    """An engine failure on process 0: the others may be inside the failed program, so the
    job ends (every process, non-zero, with this line)."""
    first = str(error).splitlines()[0] if str(error) else ""
    message = f"the engine failed while serving in lock step, so every process stops: {type(error).__name__}: {first}"
    sys.stderr.write(f"{distributed.label()}error: {message}\n")
    distributed.fail(message, 1)

  def _send(self, payload: bytes):
    n = self.sent
    if n and n % FLOW_WINDOW == 0:  # every process has run the messages a window back: delete those
      for peer in range(1, self.num_processes):
        ran = f"{_PREFIX}ran/{peer}/{n - FLOW_WINDOW}"
        self.client.blocking_key_value_get(ran, int(self.timeout_s * 1000))
        self.client.key_value_delete(ran)
      for old in range(max(n - 2 * FLOW_WINDOW, 0), n - FLOW_WINDOW):
        self.client.key_value_delete(f"{_PREFIX}{old}")
    self.client.key_value_set_bytes(f"{_PREFIX}{n}", payload)
    self.sent += 1

  # -- the other processes ------------------------------------------------------------

  def follow(self):
    """Run process 0's program calls in order until it publishes STOP."""
    n = 0
    while True:
      payload = self._receive(n)
      if payload == _STOP.encode():
        return
      index, kind, rows = pickle.loads(payload)
      rows = [self._last[x.engine][x.index] if isinstance(x, Output) else x for x in rows]
      self.returned(self.engines[index], self.engines[index].replay(kind, rows))
      if n % FLOW_WINDOW == 0:
        self.client.key_value_set(f"{_PREFIX}ran/{self.process_id}/{n}", "")
      n += 1

  def _receive(self, n: int) -> bytes:
    while True:  # an idle server sends nothing for as long as it likes; the heartbeat watches it
      try:
        return self.client.blocking_key_value_get_bytes(f"{_PREFIX}{n}", _WAIT_MS)
      except Exception as e:  # noqa: BLE001  the runtime's error type: only a timeout means "not yet"
        if "DEADLINE_EXCEEDED" not in str(e):
          raise


def _to_host(x):
  """A per-row argument as numpy (a dict of them: sampling settings)."""
  if isinstance(x, dict):
    return {k: np.asarray(v) for k, v in x.items()}
  return np.asarray(x)
