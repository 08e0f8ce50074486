"""Disaggregated prefill and decode (DistServe's split) on one host: a prefill engine on one
group of devices writes each prompt into its own KV pages; when a prompt is written, its
pages move device to device into the decode engine's pool, and the decode engine, on the
other devices, only decodes. A long prompt then never shares a step with the running
decodes: their inter-token latency does not rise with the prompts that arrive.

The move is two small programs per engine, compiled once for a whole sequence's pages: the
prefill engine gathers the request's pages (and, for a quantized cache, its float tail page
by slot) out of its cache; `jax.device_put` carries them onto the decode engine's devices
laid out as its cache; the decode engine scatters them into the pages it allocates for the
request (and the tail into the slot it takes) before the request's first decode step. Pages
past the sequence's are padding: gathered as anything, written nowhere. Each move is counted
in the decode engine's stats (`kv_transfers`, `kv_transfer_bytes`, `kv_transfer_seconds`:
from the gather to the transfer's end, as the prefill thread waits on it).

Both engines are whole engines: the prefill engine's prefix cache serves repeated prompts,
and a decode engine that must preempt a request recomputes it itself, as always.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.inference.engine import Engine
from jaxpar.inference.sampling import GREEDY, SamplingParams
from jaxpar.mesh import logical_to_sharding
from jaxpar.models import kv_cache


def _by_slot(path) -> bool:
  """A leaf of per-slot pages (a quantized cache's float tail) rather than pool pages."""
  return any(getattr(key, "key", None) in ("tail_k", "tail_v") for key in path)


class PageMover:
  """The gather and scatter programs of one engine's cache layout (axis 2 of every leaf:
  pool pages, or slots for the tails)."""

  def __init__(self, engine):
    self.engine, self.width = engine, engine.pages_per_seq

    def gather(cache, pages, slot):
      return jax.tree_util.tree_map_with_path(
          lambda path, x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=2) if _by_slot(path) else
          jnp.take(x, pages, axis=2, mode="fill"), cache)

    def scatter(cache, moved, pages, slot):
      return jax.tree_util.tree_map_with_path(
          lambda path, x, m: jax.lax.dynamic_update_slice_in_dim(x, m, slot, axis=2) if _by_slot(path) else
          x.at[:, :, pages].set(m, mode="drop"), cache, moved)
    runtime = engine.runtime
    shardings = jax.tree.map(lambda x: x.sharding, engine.cache)
    with runtime.context():
      self.gather = jax.jit(gather)
      self.scatter = jax.jit(scatter, donate_argnums=0, out_shardings=shardings)

  def table(self, pages: list[int]) -> np.ndarray:
    """A sequence's pages padded to the widest table with a page that is not there."""
    row = np.full((self.width,), self.engine.pool.num_pages, np.int32)
    row[:len(pages)] = pages
    return row

  def shardings(self, moved):
    """Where moved pages go on this engine's devices: laid out as its cache."""
    runtime = self.engine.runtime
    return jax.tree.map(lambda x: logical_to_sharding(kv_cache.STACKED_NAMES, x.shape, runtime.mesh, runtime.rules),
                        moved)


class Disaggregated:
  """A prefill engine and a decode engine of one model, each on its own devices.

  Build both with the same model, cache kind and page size, e.g.
  `Disaggregated(Engine.from_checkpoint(run, devices=d[:4]), Engine.from_checkpoint(run, devices=d[4:]))`.
  `submit`/`generate` for the Python API (one thread: a prefill step, then a decode step);
  `jaxpar serve --prefill-devices N` runs each engine on its own thread."""

  def __init__(self, prefill, decode):
    _check_pair(prefill, decode)
    self.prefill, self.decode = prefill, decode
    self.engines = [prefill, decode]
    self._from, self._to = PageMover(prefill), PageMover(decode)
    self.deliver = self._queue_for_decode  # the server's: its decode thread's queue, which wakes it
    prefill.handoff = self._hand_off
    decode.adopt = self._adopt

  def _queue_for_decode(self, requests):
    for request in requests:
      self.decode.enqueue(request)

  def pick(self, ids, adapter: int = 0) -> int:
    """Every request starts on the prefill engine (the server's routing asks)."""
    return 0

  def _hand_off(self, request, slot: int):
    """On the prefill engine's thread: take the request's pages off its devices, onto the
    decode engine's, then free them here."""
    started = time.perf_counter()
    moved = self._from.gather(self.prefill.cache, self._from.table(request.pages), slot)
    moved = jax.device_put(moved, self._to.shardings(moved))
    jax.block_until_ready(moved)  # the pages are reused once freed below
    stats = self.decode.stats
    stats["kv_transfers"] += 1
    stats["kv_transfer_bytes"] += sum(x.nbytes for x in jax.tree.leaves(moved))
    stats["kv_transfer_seconds"] += time.perf_counter() - started
    self.prefill._release(request)
    request.moved = moved
    self.deliver([request])

  def _adopt(self, request, slot: int) -> bool:
    """On the decode engine's thread: pages for the request's prompt here (False: none free
    yet) and its moved pages written into them and into `slot`'s tail."""
    engine = self.decode
    if not engine._grow(request, request.cached):
      return False
    engine.cache = self._to.scatter(engine.cache, request.moved, self._to.table(request.pages), slot)
    request.moved, request.published = None, 0
    engine.sharing.publish(request)
    return True

  # -- one thread ----------------------------------------------------------------------

  def submit(self, prompt, sampling: SamplingParams = GREEDY, on_event=None):
    """Queue a prompt on the prefill engine (as Engine.submit)."""
    return self.prefill.submit(prompt, sampling, on_event)

  @property
  def has_work(self) -> bool:
    return self.prefill.has_work or self.decode.has_work

  def step(self) -> list:
    return self.prefill.step() + self.decode.step()

  # Complete every prompt, prefill and decode in turn on this thread: the engine's own loop
  # over submit and step.
  generate = Engine.generate

_NO_SPECULATION = "speculative decoding with disaggregated prefill is not supported: serve one or the other"


def split_devices(prefill: int, replicas: int = 1, devices=None, speculative: bool = False) -> list[list]:
  """[the first `prefill` devices, the rest], or a one-line error (before anything compiles)."""
  devices = list(jax.devices() if devices is None else devices)
  if replicas != 1:
    raise ConfigError("--prefill-devices with --replicas: choose one (replicas of disaggregated pairs are not built)")
  if speculative:
    raise ConfigError(_NO_SPECULATION)
  if not 0 < prefill < len(devices):
    raise ConfigError(f"--prefill-devices {prefill} leaves no devices to decode on, or none to prefill on: give "
                      f"1 to {len(devices) - 1} of the {len(devices)} devices")
  return [devices[:prefill], devices[prefill:]]


def _check_pair(prefill, decode):
  """One-line errors for engines that cannot hand prompts over."""
  devices = {d.id for d in prefill.runtime.mesh.devices.flat}
  if devices & {d.id for d in decode.runtime.mesh.devices.flat}:
    raise ConfigError("the prefill and decode engines share devices: give each its own (--prefill-devices N leaves "
                      "the rest to decode)")
  same = prefill.runtime.model_config == decode.runtime.model_config and prefill.adapters == decode.adapters
  layout = (prefill.pool.page_size, prefill.kv_quantization, prefill.max_seq_len) == \
      (decode.pool.page_size, decode.kv_quantization, decode.max_seq_len)
  if not same or not layout:
    raise ConfigError("the prefill and decode engines must serve the same model, adapters, page size, KV cache "
                      "kind and context: build both from the same run and options")
  if prefill.draft is not None or decode.draft is not None:
    raise ConfigError(_NO_SPECULATION)
  if prefill.local_window is not None or prefill.cache_bytes["states"]:
    raise ConfigError("disaggregated prefill moves pool pages only: this model's local-window rings or "
                      "linear-attention states stay where they were written; serve it co-located")
