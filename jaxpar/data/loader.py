"""`TrainBatches`: deterministic, resumable global batches of packed windows.

Sample k of the run is window `order[k]` of a Grain shuffle that reshuffles every epoch
(`MapDataset.source(windows).shuffle(seed).repeat()`), and the batch that starts at
sample k holds samples k .. k+global_batch-1. Random access makes the iterator state one
integer, valid on any number of processes and any mesh: each process reads just the rows
of the global batch that its devices hold.
"""

from __future__ import annotations

from typing import Any

import grain
import jax
import numpy as np

from jaxpar.data.packing import PackedStream, pack_documents
from jaxpar.data.sources import read_documents
from jaxpar.data.tokenizer import load_tokenizer
from jaxpar.errors import CheckpointError, ConfigError, DataError

KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


class _Windows:
  """Random-access source of packed examples for Grain: element i is window i."""

  def __init__(self, stream: PackedStream, seq_len: int):
    self._stream, self._seq_len = stream, seq_len
    self._n = stream.num_windows(seq_len)

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    return self._stream.window(int(i), self._seq_len)


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


class TrainBatches:
  """Endless iterator of global batches: dict of [global_batch, seq_len] arrays.

  `inputs`, `targets`, `segment_ids`, `positions` are int32, `loss_mask` float32.
  With `sharding=None` it yields this process's rows as numpy arrays instead.
  """

  def __init__(self, data_config, tokenizer=None, sharding=None):
    cfg = data_config
    self.seq_len = int(cfg.seq_len)
    self.global_batch_size = int(cfg.global_batch_size)
    self.seed = int(cfg.shuffle_seed)
    if self.seq_len < 1 or self.global_batch_size < 1:
      raise DataError(
        f"data.seq_len={cfg.seq_len} and data.global_batch_size={cfg.global_batch_size} "
        "must both be >= 1"
      )
    nproc = jax.process_count()
    if self.global_batch_size % nproc:
      raise DataError(
        f"data.global_batch_size={self.global_batch_size} does not divide over "
        f"{nproc} processes; use a multiple of {nproc}"
      )
    if tokenizer is None or isinstance(tokenizer, str):
      tokenizer = load_tokenizer(tokenizer or cfg.tokenizer)
    self.tokenizer = tokenizer
    self.source = cfg.source
    self.stream = pack_documents(read_documents(cfg.source, cfg.text_key), tokenizer)
    self.windows_per_epoch = self.stream.num_windows(self.seq_len)
    if self.windows_per_epoch < self.global_batch_size:
      raise DataError(
        f"data.source={cfg.source!r} has {self.stream.num_tokens} tokens = "
        f"{self.windows_per_epoch} windows of data.seq_len={self.seq_len}, fewer than one "
        f"batch of data.global_batch_size={self.global_batch_size}; use more text, a "
        "shorter seq_len or a smaller batch"
      )
    self._dataset = (
      grain.MapDataset.source(_Windows(self.stream, self.seq_len))
      .shuffle(seed=self.seed)
      .repeat()
    )
    self.sharding = sharding
    shape = (self.global_batch_size, self.seq_len)
    if sharding is None:
      per = self.global_batch_size // nproc
      self._rows = np.arange(jax.process_index() * per, (jax.process_index() + 1) * per)
    else:
      try:
        sharding.shard_shape(shape)
      except ValueError as e:
        raise ConfigError(f"batch shape {shape} does not fit sharding {sharding}: {e}") from None
      mine = [d for d in sharding.device_set if d.process_index == jax.process_index()]
      self._rows = rows_held_by(sharding, mine, *shape)
    self._next = 0  # index of the first sample of the next batch

  # -- iteration -------------------------------------------------------------------

  def local_batch(self, start: int, rows=None) -> dict[str, np.ndarray]:
    """`rows` (default: this process's rows) of the global batch that begins at sample `start`."""
    examples = [self._dataset[start + int(r)] for r in (self._rows if rows is None else rows)]
    return {k: np.stack([ex[k] for ex in examples]) for k in KEYS}

  def __iter__(self) -> "TrainBatches":
    return self

  def __next__(self) -> dict[str, Any]:
    local = self.local_batch(self._next)
    self._next += self.global_batch_size
    if self.sharding is None:
      return local
    shape = (self.global_batch_size, self.seq_len)
    return {
      k: jax.make_array_from_process_local_data(self.sharding, v, shape)
      for k, v in local.items()
    }

  # -- checkpointing ---------------------------------------------------------------

  def get_state(self) -> dict[str, int]:
    # Counted in samples, not steps, so a resumed run may change the batch size.
    return {"next_sample": self._next}

  def set_state(self, state: dict[str, Any]) -> None:
    if "next_sample" not in state:
      raise CheckpointError(f"data iterator state {state!r} has no 'next_sample'")
    nxt = int(np.asarray(state["next_sample"]))  # orbax may hand back a numpy scalar
    if nxt < 0:
      raise CheckpointError(f"data iterator state next_sample={nxt} must be >= 0")
    self._next = nxt

  # -- sizes -----------------------------------------------------------------------

  def num_tokens(self) -> int:
    """Tokens in one pass over the corpus (eos included)."""
    return self.stream.num_tokens

  @property
  def epoch(self) -> float:
    """Passes over the corpus made so far (fractional)."""
    return self._next / self.windows_per_epoch

  def __repr__(self) -> str:
    return (
      f"TrainBatches(source={self.source!r}, tokens={self.num_tokens()}, "
      f"windows={self.windows_per_epoch}, seq_len={self.seq_len}, "
      f"global_batch={self.global_batch_size}, seed={self.seed})"
    )
