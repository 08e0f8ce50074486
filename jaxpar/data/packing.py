"""Pack documents into one token stream and cut it into fixed training windows.

Every document is followed by eos and all of them are concatenated. Window i is
stream[i*L : i*L + L + 1] (L = seq_len): L inputs plus the one extra token that the last
input predicts, so consecutive windows share one token and no token is lost. A window
spans several documents; segment ids keep attention inside each one.

A document longer than a window is split across consecutive windows: each piece is its
own segment, with positions counting from 0 again at the window's start, so the model
sees it as a new sequence and never attends from one piece to another.

The stream is a view: flat token storage (an array in memory or a memory-mapped token
cache) with each document's start, and the documents it holds, in order. `split` holds out
documents by a seeded draw per document, so the two parts never share a document.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class PackedStream:
  """tokens: every document's tokens (eos included) back to back, any integer dtype;
  starts: [documents + 1] offsets of each document in `tokens` (the last: the end);
  documents: which documents this stream holds, in order (default: all)."""

  def __init__(self, tokens: np.ndarray, starts: np.ndarray, documents: np.ndarray | None = None):
    starts = np.asarray(starts, np.int64)
    if tokens.ndim != 1 or starts.ndim != 1 or not len(starts) or starts[-1] != tokens.shape[0]:
      raise ValueError(f"starts (ending at {starts[-1] if len(starts) else None}) must end at the "
                       f"{tokens.shape[0]} tokens")
    self.tokens, self.starts = tokens, starts
    self._contiguous = documents is None and starts[0] == 0
    self._documents = None if documents is None else np.asarray(documents, np.int64)
    if self._contiguous:  # no copy: a memory-mapped cache's offsets stay on disk
      self._offsets = starts
    else:  # where each held document starts in this stream: it skips the ones it does not hold
      self._documents = self.documents
      lengths = starts[1:][self._documents] - starts[:-1][self._documents]
      self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

  @property
  def num_tokens(self) -> int:
    return int(self._offsets[-1])

  @property
  def documents(self) -> np.ndarray:
    """The indices of the documents this stream holds, in order."""
    return np.arange(len(self.starts) - 1) if self._documents is None else self._documents

  @property
  def num_documents(self) -> int:
    return len(self.starts) - 1 if self._documents is None else len(self._documents)

  def num_windows(self, seq_len: int) -> int:
    # Window i needs tokens up to i*L + L inclusive.
    return max(0, (self.num_tokens - 1) // seq_len)

  def span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, each one's document number in this stream) of stream positions [start, stop)."""
    positions = np.arange(start, stop)
    document = np.searchsorted(self._offsets, positions, side="right") - 1
    if self._contiguous:
      return np.asarray(self.tokens[start:stop]), document
    physical = positions - self._offsets[document] + self.starts[self._documents[document]]
    return np.asarray(self.tokens[physical]), document

  def window(self, i: int, seq_len: int) -> dict[str, np.ndarray]:
    if not 0 <= i < self.num_windows(seq_len):
      raise IndexError(f"window {i} out of range [0, {self.num_windows(seq_len)})")
    return make_example(*self.span(i * seq_len, i * seq_len + seq_len + 1))

  def split(self, fraction: float, seed: int) -> tuple["PackedStream", "PackedStream"]:
    """(kept, held out): each document is held out with probability `fraction`, drawn from
    `seed` and its index, so the split is the same on every process and every run."""
    draw = np.random.default_rng([seed, 0x5EED]).random(len(self.starts) - 1)[self.documents]
    held = draw < fraction
    return (PackedStream(self.tokens, self.starts, self.documents[~held]),
            PackedStream(self.tokens, self.starts, self.documents[held]))


def pack_documents(docs: Sequence, tokenizer) -> PackedStream:
  """Tokenize `docs` (eos after each) into one stream. A document is text, or (pre-tokenized)
  an array of token ids. Uses `tokenizer.encode_batch` when the tokenizer has it."""
  texts = [d for d in docs if isinstance(d, str)]
  if len(texts) == len(docs) and hasattr(tokenizer, "encode_batch"):
    pieces = tokenizer.encode_batch(list(docs))
  else:
    pieces = [np.asarray(tokenizer.encode(d) if isinstance(d, str) else d, np.int32) for d in docs]
  return concatenate(pieces, tokenizer.eos_id)


def concatenate(pieces: Sequence[np.ndarray], eos_id: int) -> PackedStream:
  """Token arrays, eos appended to each, as one stream."""
  # The eos belongs to the document it ends, so a document's last word still learns to
  # predict eos; only eos -> next document's first token is masked.
  eos = np.array([eos_id], dtype=np.int32)
  parts = [part for p in pieces for part in (np.asarray(p, np.int32), eos)]
  tokens = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
  lengths = np.array([len(p) + 1 for p in pieces], dtype=np.int64)
  return PackedStream(tokens, np.concatenate([[0], np.cumsum(lengths)]))


def make_example(window: np.ndarray, window_doc_ids: np.ndarray) -> dict[str, np.ndarray]:
  """L+1 tokens (and their document ids) -> the five [L] arrays a train step consumes."""
  window = np.asarray(window, dtype=np.int32)
  doc = np.asarray(window_doc_ids)
  length = window.shape[0] - 1
  in_doc, tgt_doc = doc[:-1], doc[1:]
  # A new segment starts wherever the input's document changes.
  starts = np.ones((length,), dtype=bool)
  starts[1:] = in_doc[1:] != in_doc[:-1]
  segment_ids = np.cumsum(starts, dtype=np.int32)
  idx = np.arange(length, dtype=np.int32)
  seg_start = np.maximum.accumulate(np.where(starts, idx, 0))
  return {
    "inputs": window[:-1],
    "targets": window[1:],
    "segment_ids": segment_ids,
    "positions": (idx - seg_start).astype(np.int32),
    "loss_mask": (in_doc == tgt_doc).astype(np.float32),
  }
