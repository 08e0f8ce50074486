"""Global batches of packed windows: `TrainBatches` (the training mixture: shuffled, endless,
resumable) and `EvalBatches` (one eval set: in order, once).

Sample k of the run is `Mixture.dataset[k]` (mixture.py), and the training batch that
starts at sample k holds samples k .. k+global_batch-1. Random access makes the iterator
state one integer, valid on any number of processes and any mesh: each process reads just
the rows of the global batch that its devices hold, so a restart on another process count
continues at the same global position.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxpar.data.mixture import Mixture, Source, open_sources
from jaxpar.data.packing import PackedStream
from jaxpar.data.tokenizer import load_tokenizer
from jaxpar.errors import CheckpointError, ConfigError, DataError

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
TOKEN_KEYS = KEYS[:4]  # int32; the others (and any an objective adds) float32


def rows_held_by(sharding, devices, batch: int, seq_len: int) -> np.ndarray:
  """Global batch rows that `devices` hold under `sharding`, in the order
  `make_array_from_process_local_data` expects a process's rows (ascending, deduplicated).
  A process loads the rows of its own devices: disjoint from another process's unless the
  mesh repeats the batch across them (e.g. a tensor axis spanning processes)."""
  devices = set(devices)
  spans = set()
  for device, idx in sharding.devices_indices_map((batch, seq_len)).items():
    if device in devices:
      start, stop, _ = idx[0].indices(batch)
      spans.add((start, stop))
  return np.unique(np.concatenate([np.arange(a, b) for a, b in sorted(spans)]))


def _process_rows(sharding, batch: int, seq_len: int) -> np.ndarray:
  """This process's rows of a [batch, seq_len] global batch (all rows' share when unsharded)."""
  nproc = jax.process_count()
  if batch % nproc:
    raise DataError(f"a batch of {batch} rows does not divide over {nproc} processes; use a multiple of {nproc}")
  if sharding is None:
    per = batch // nproc
    return np.arange(jax.process_index() * per, (jax.process_index() + 1) * per)
  try:
    sharding.shard_shape((batch, seq_len))
  except ValueError as e:
    raise ConfigError(f"batch shape {(batch, seq_len)} does not fit sharding {sharding}: {e}") from None
  mine = [d for d in sharding.device_set if d.process_index == jax.process_index()]
  return rows_held_by(sharding, mine, batch, seq_len)


def _globalize(local: dict, sharding, shape) -> dict:
  if sharding is None:
    return local
  return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}


class TrainBatches:
  """Endless iterator of global batches: dict of [global_batch, seq_len] arrays.

  `inputs`, `targets`, `segment_ids`, `positions` are int32, `loss_mask` float32.
  With `sharding=None` it yields this process's rows as numpy arrays instead. `sources`
  (mixture.open_sources) when already opened; default: the config's, read here.
  """

  def __init__(self, data_config, tokenizer=None, sharding=None, sources: dict[str, Source] | None = None):
    cfg = data_config
    self.seq_len = int(cfg.seq_len)
    self.global_batch_size = int(cfg.global_batch_size)
    self.seed = int(cfg.shuffle_seed)
    if self.seq_len < 1 or self.global_batch_size < 1:
      raise DataError(f"data.seq_len={cfg.seq_len} and data.global_batch_size={cfg.global_batch_size} "
                      "must both be >= 1")
    if self.global_batch_size % jax.process_count():
      raise DataError(f"data.global_batch_size={self.global_batch_size} does not divide over "
                      f"{jax.process_count()} processes; use a multiple of {jax.process_count()}")
    if tokenizer is None or isinstance(tokenizer, str):
      tokenizer = load_tokenizer(tokenizer or cfg.tokenizer)
    self.tokenizer = tokenizer
    self.sources = sources if sources is not None else open_sources(cfg, tokenizer)
    training = [s for s in self.sources.values() if s.weight > 0]
    for s in training:
      self._check_size(cfg, s, len(training))
    self.mixture = Mixture(training, self.seq_len, self.seed)
    self.names = [s.name for s in self.mixture.sources]
    self.weights = np.array([s.weight for s in self.mixture.sources]) / sum(s.weight for s in training)
    self.sharding = sharding
    self._rows = _process_rows(sharding, self.global_batch_size, self.seq_len)
    self._next = 0  # index of the first sample of the next batch
    self._seen = np.zeros(len(training), np.int64)  # samples drawn from each source so far

  def _check_size(self, cfg, source: Source, count: int):
    stream, needed = source.train, self.global_batch_size if count == 1 else 1
    if stream.num_windows(self.seq_len) < needed:
      where = cfg.source if count == 1 and not cfg.sources else f"data.sources.{source.name}"
      raise DataError(f"data.source={where!r} has {stream.num_tokens} tokens = {stream.num_windows(self.seq_len)} "
                      f"windows of data.seq_len={self.seq_len}, fewer than "
                      + (f"one batch of data.global_batch_size={self.global_batch_size}" if count == 1 else "one")
                      + "; use more text, a shorter seq_len or a smaller batch")

  @property
  def stream(self) -> PackedStream:
    """The training stream of a single-source run."""
    (only,) = self.mixture.sources
    return only.train

  @property
  def windows_per_epoch(self) -> int:
    return sum(s.train.num_windows(self.seq_len) for s in self.mixture.sources)

  # -- iteration -------------------------------------------------------------------

  def local_batch(self, start: int, rows=None) -> dict[str, np.ndarray]:
    """`rows` (default: this process's rows) of the global batch that begins at sample `start`."""
    examples = [self.mixture.dataset[start + int(r)] for r in (self._rows if rows is None else rows)]
    return {k: np.stack([ex[k] for ex in examples]) for k in KEYS}

  def __iter__(self) -> "TrainBatches":
    return self

  def __next__(self) -> dict[str, Any]:
    local = self.local_batch(self._next)
    samples = range(self._next, self._next + self.global_batch_size)
    self._seen += np.bincount(self.mixture.source_of(samples), minlength=len(self._seen))
    self._next += self.global_batch_size
    return _globalize(local, self.sharding, (self.global_batch_size, self.seq_len))

  def proportions(self) -> dict[str, float]:
    """The share of the samples so far that came from each training source."""
    total = max(int(self._seen.sum()), 1)
    return {name: int(n) / total for name, n in zip(self.names, self._seen)}

  # -- checkpointing ---------------------------------------------------------------

  def get_state(self) -> dict[str, Any]:
    # Counted in samples, not steps, so a resumed run may change the batch size.
    state = {"next_sample": self._next}
    if len(self.names) > 1:
      state["source_samples"] = {n: int(c) for n, c in zip(self.names, self._seen)}
    return state

  def set_state(self, state: dict[str, Any]) -> None:
    if "next_sample" not in state:
      raise CheckpointError(f"data iterator state {state!r} has no 'next_sample'")
    nxt = int(np.asarray(state["next_sample"]))  # orbax may hand back a numpy scalar
    if nxt < 0:
      raise CheckpointError(f"data iterator state next_sample={nxt} must be >= 0")
    self._next = nxt
    seen = state.get("source_samples") or {}
    if len(self.names) == 1:
      self._seen = np.array([nxt], np.int64)
    elif set(seen) == set(self.names):
      self._seen = np.array([int(seen[n]) for n in self.names], np.int64)
    else:  # a state saved with other sources: count again (a pure function of the position)
      self._seen = np.bincount(self.mixture.source_of(range(nxt)), minlength=len(self.names))

  # -- sizes -----------------------------------------------------------------------

  def num_tokens(self) -> int:
    """Tokens in one pass over the training sources (eos included)."""
    return sum(s.train.num_tokens for s in self.mixture.sources)

  @property
  def epoch(self) -> float:
    """Passes over the training windows made so far (fractional)."""
    return self._next / self.windows_per_epoch

  def __repr__(self) -> str:
    return (f"TrainBatches(sources={self.names}, tokens={self.num_tokens()}, "
            f"windows={self.windows_per_epoch}, seq_len={self.seq_len}, "
            f"global_batch={self.global_batch_size}, seed={self.seed})")


class EvalBatches:
  """One eval set's consecutive windows, in order, `batch_size` at a time, once: the same
  on every run, process count and mesh. `steps` batches (None: all). A last partial batch
  is filled with rows of loss mask 0, so every batch has one shape (one compiled program).

  Each batch also holds `target_bytes` [B, L] float32: the UTF-8 bytes each target token
  stands for (`byte_lengths`, a table by token id), for bits per byte.
  """

  def __init__(self, stream: PackedStream, seq_len: int, batch_size: int, byte_lengths: np.ndarray,
               sharding=None, steps: int | None = None):
    self.stream, self.seq_len, self.batch_size = stream, seq_len, batch_size
    self.windows = stream.num_windows(seq_len)
    if not self.windows:
      raise DataError(f"an eval set of {stream.num_tokens} tokens holds no window of data.seq_len={seq_len}: "
                      "hold out more documents or evaluate on a larger set")
    available = -(-self.windows // batch_size)
    self.steps = available if steps is None else min(steps, available)
    self.byte_lengths = np.asarray(byte_lengths, np.float32)
    self.sharding = sharding
    self._rows = _process_rows(sharding, batch_size, seq_len)

  def __len__(self) -> int:
    return self.steps

  def batch(self, index: int) -> dict[str, Any]:
    local = {k: [] for k in (*KEYS, "target_bytes")}
    for row in self._rows:
      window = index * self.batch_size + int(row)
      example = self.stream.window(min(window, self.windows - 1), self.seq_len)
      if window >= self.windows:  # padding: scored as nothing
        example["loss_mask"] = np.zeros_like(example["loss_mask"])
      example["target_bytes"] = self.byte_lengths[example["targets"]] * example["loss_mask"]
      for k, v in example.items():
        local[k].append(v)
    local = {k: np.stack(v) for k, v in local.items()}
    return _globalize(local, self.sharding, (self.batch_size, self.seq_len))

  def __iter__(self):
    return (self.batch(i) for i in range(self.steps))
