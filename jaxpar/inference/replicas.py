"""Data-parallel serving replicas: N engines on disjoint groups of devices, each with its own
cache, behind one server, and the rule that picks which one serves a request.

Routing is prefix-aware and load-aware, in the spirit of DualMap's two-choice hashing. A
prompt's first page of tokens (and its adapter) hashes to two replicas, so requests sharing a
system prompt or a conversation's history meet on the same two, and one of them holds their
pages even before the first such request has written them. Of the two, the one whose prefix
cache already holds more of the prompt takes it (a tie: the first choice). If that one's load
(requests waiting or running) is more than `slack` above the least loaded replica's, the
request goes to the less loaded of the two instead, or, if that one is past the bound too,
to the least loaded replica of all: a hot prefix spills over rather than queueing behind
itself.
"""

import hashlib

import jax

from jaxpar.errors import ConfigError
from jaxpar.inference.pages import block_hashes
from jaxpar.inference.prefix_cache import chain_start


def device_groups(replicas: int, devices=None) -> list[list]:
  """`devices` (default: all) in `replicas` consecutive groups of equal size, or a one-line
  error naming the counts that divide them."""
  devices = list(jax.devices() if devices is None else devices)
  if replicas < 1 or len(devices) % replicas:
    fits = [n for n in range(1, len(devices) + 1) if len(devices) % n == 0]
    raise ConfigError(f"--replicas {replicas} does not divide the {len(devices)} devices into equal groups: "
                      f"choose one of {fits}")
  size = len(devices) // replicas
  return [devices[i * size:(i + 1) * size] for i in range(replicas)]


def load(engine) -> int:
  """Requests an engine has waiting or running (read from another thread: a routing hint)."""
  return engine.pending + sum(r is not None for r in engine.slots)


class Replicas:
  """Engines of one model, each on its own devices, and where each request goes.

  slack: how many more requests than the least loaded replica a prefix's replica may have
  before a request sharing that prefix goes elsewhere (default: one replica's slots)."""

  def __init__(self, engines, slack: int | None = None):
    self.engines = list(engines)
    first = self.engines[0]
    if any(e.runtime.model_config != first.runtime.model_config or e.adapters != first.adapters
           or e.pool.page_size != first.pool.page_size for e in self.engines):
      raise ConfigError("replicas must serve the same model, adapters and page size: build every engine from the "
                        "same run and options")
    self.slack = len(first.slots) if slack is None else slack
    if self.slack < 0:
      raise ConfigError(f"slack={slack} must be >= 0 (requests beyond the least loaded replica's)")
    self.routed = [0] * len(self.engines)  # requests each replica was given

  def __len__(self) -> int:
    return len(self.engines)

  def choices(self, ids: list[int], adapter: int) -> tuple[int, int]:
    """The two replicas a prompt's first block hashes to (the same one twice for one replica)."""
    size = self.engines[0].pool.page_size
    key = hashlib.blake2b(chain_start(adapter) + ",".join(map(str, ids[:size])).encode(), digest_size=8).digest()
    number, count = int.from_bytes(key, "little"), len(self.engines)
    first = number % count
    return first, (first + 1 + (number // count) % (count - 1)) % count if count > 1 else first

  def _hashes(self, ids: list[int], adapter: int) -> list[bytes]:
    """The prompt's block hashes, as every replica's prefix cache indexes them (one page size)."""
    return block_hashes(ids[:len(ids) - 1], self.engines[0].pool.page_size, 0, chain_start(adapter))

  def cached_tokens(self, index: int, ids: list[int], adapter: int, hashes=None) -> int:
    """Leading prompt tokens replica `index`'s prefix cache holds now."""
    pool = self.engines[index].pool
    return pool.cached_run(hashes if hashes is not None else self._hashes(ids, adapter)) * pool.page_size

  def pick(self, ids: list[int], adapter: int = 0) -> int:
    """The replica that serves a prompt of token `ids` (adapter: its stacked adapter's number)."""
    if len(self.engines) == 1:
      return 0
    first, second = self.choices(ids, adapter)
    loads = [load(e) for e in self.engines]
    hashes = self._hashes(ids, adapter)  # once, for both choices
    preferred, other = first, second
    if self.cached_tokens(second, ids, adapter, hashes) > self.cached_tokens(first, ids, adapter, hashes):
      preferred, other = second, first
    least = min(range(len(loads)), key=loads.__getitem__)
    chosen = next((c for c in (preferred, other) if loads[c] - loads[least] <= self.slack), least)
    self.routed[chosen] += 1
    return chosen
