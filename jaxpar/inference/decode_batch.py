"""The engine's decode calls: the rows a call runs, the inputs they take, the outputs it
leaves on the device until the engine reads them, and the tokens turned into events.

A call runs one decode step (or a burst of `steps`) for every slot ready to decode; idle
slots ride along at position -1, which writes and reads nothing. While nothing can change
between steps, the engine dispatches the step after a call before reading that call's
tokens (`Engine(run_ahead=True)`): the next step's tokens are the call's outputs, still on
the device, so the host's work on this step's tokens (streaming text, stop checks, the
prefix index) runs while the device computes the next one. On bench-20m's batch-32 CPU
decode that hid about 1 ms of each step (`benchmarks/decode_floor.py`). A request that
arrives while a step runs ahead waits for it to be read: its prefill may preempt a row.
"""

import dataclasses

import numpy as np

from jaxpar.inference import processing
from jaxpar.inference.pages import page_table_rows
from jaxpar.inference.sampling import row_arrays


@dataclasses.dataclass
class DecodeBatch:
  """A decode call dispatched: rows (a Request, or None for an idle slot), the steps it
  runs, each row's input position [B, 1] (-1: idle), the rows' sampling settings
  (`sampling.row_arrays`) and the outputs on the device: tokens and log-probabilities
  [B, steps], then, for requests that adjust logits, the alternatives' ids and log-probabilities."""
  rows: list
  steps: int
  positions: np.ndarray
  settings: dict
  outputs: tuple


def first_inputs(rows) -> tuple[np.ndarray, np.ndarray]:
  """Tokens and positions [B, 1] of a call from the host: each row's last token at its position."""
  tokens = np.zeros((len(rows), 1), np.int32)
  positions = np.full((len(rows), 1), -1, np.int32)
  for i, request in enumerate(rows):
    if request is not None:
      tokens[i, 0], positions[i, 0] = request.last_token, request.length - 1
  return tokens, positions


def following_rows(batch: DecodeBatch) -> tuple[list, np.ndarray]:
  """Rows and positions [B, 1] of the step after a one-step `batch`, dispatched before its
  tokens are read: the same rows one position on, except those that have ended since their
  step was dispatched, which sit idle (their pages may already serve other rows)."""
  rows = [r if r is not None and r.finish_reason is None else None for r in batch.rows]
  positions = np.where([[r is not None] for r in rows], batch.positions + 1, -1).astype(np.int32)
  return rows, positions


class DecodeCalls:
  """The engine's decode calls (`Engine` inherits them): turn the slots ready to decode into
  a call, and its tokens back into each request's events."""

  def _uninterrupted(self, steps: int) -> bool:
    """Whether the running requests can take `steps` more decode steps with nothing changing
    between them: none waiting or prefilling, none cancelled, adjusting logits or yet to
    stream its first token, each with that many tokens still to go and their pages free."""
    running = [r for r in self.slots if r is not None]
    if self.pending or any(r.prefilling or r.cancelled or r.sampling.processed or not r.generated
                           or r.sampling.max_tokens - len(r.generated) < steps
                           or r.length + steps - 1 > self.max_seq_len for r in running):
      return False
    need = sum(max(self.pool.pages_for(r.length + steps - 1) - len(r.pages), 0) for r in running)
    return need <= self.pool.free

  def _decode(self) -> list:
    """Read the decode call in flight (dispatching one first if none is), dispatch the next
    step before that where nothing can change (`run_ahead`), and accept the tokens."""
    batch, self._ahead = self._ahead, None
    if batch is None:
      steps = self.decode_burst if self.decode_burst > 1 and self._uninterrupted(self.decode_burst) else 1
      for request in sorted((r for r in self.slots if r is not None and not r.prefilling),
                            key=lambda r: r.arrival):
        if request in self.slots:  # not preempted by an older request's growth
          self._reserve(request, request.length + steps - 1)
      rows = [r if r is not None and not r.prefilling else None for r in self.slots]
      batch = self._dispatch(rows, steps, *first_inputs(rows))
    if self.run_ahead and batch.steps == 1 and self._uninterrupted(2):  # this step's token + the next
      rows, positions = following_rows(batch)
      for request in rows:
        if request is not None:
          self._grow(request, request.length + 1)  # cannot fail: _uninterrupted counted the pages
      self._ahead = self._dispatch(rows, 1, batch.outputs[0], positions, batch.settings)
      self.stats["decode_steps_ahead"] += 1
    return self._accept(batch)

  def _dispatch(self, rows, steps, tokens, positions, settings=None) -> DecodeBatch:
    longest = max(len(r.pages) for r in rows if r is not None)
    table = page_table_rows([r.pages if r else [] for r in rows],
                            next(w for w in self.step_widths if w >= longest), self.pool.num_pages)
    settings = row_arrays([r.sampling if r else None for r in rows]) if settings is None else settings
    slots = np.arange(len(rows), dtype=np.int32)
    if any(r is not None and r.sampling.processed for r in rows):
      extras = processing.extras_arrays(rows, self.runtime.model_config.vocab_size, self.max_seq_len)
      *outputs, self.cache = self._run("step_processed", tokens, positions, table, slots, settings, extras)
    else:
      *outputs, self.cache = self._run("step" if steps == 1 else "burst", tokens, positions, table, slots,
                                       settings)
    return DecodeBatch(rows, steps, positions, settings, tuple(outputs))

  def _accept(self, batch: DecodeBatch) -> list:
    """The tokens of a decode call, each row's [steps]: a burst's later tokens for a request
    that ended earlier in it, and any for a request that ended before, are dropped."""
    rows, steps = batch.rows, batch.steps
    next_tokens, logprobs = (np.asarray(x).reshape(len(rows), steps).tolist() for x in batch.outputs[:2])
    top = None
    if len(batch.outputs) > 2:
      top = zip(np.asarray(batch.outputs[2]).tolist(), np.asarray(batch.outputs[3]).tolist())
      top = [list(zip(ids, lps)) for ids, lps in top]
    events = []
    for i, request in enumerate(rows):
      for token, logprob in zip(next_tokens[i], logprobs[i]):
        if request is None or request.finish_reason is not None:
          break
        request.cached = request.length
        self.sharing.publish(request)
        event = request.accept(token, logprob, self.tokenizer.decode, self.max_seq_len, top[i] if top else None)
        if request.finish_reason is not None:
          self._free(request)
        events.append(self._deliver(request, event))
    self.stats["decode_steps"] += steps
    self.stats["decode_bursts"] += int(steps > 1)
    return events
