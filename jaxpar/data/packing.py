"""Pack documents into one token stream and cut it into fixed training windows.

Every document is followed by eos and all of them are concatenated. Window i is
stream[i*L : i*L + L + 1] (L = seq_len): L inputs plus the one extra token that the last
input predicts, so consecutive windows share one token and no token is lost. A window
spans several documents; segment ids keep attention inside each one.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class PackedStream:
  """The whole corpus as two flat int32 arrays: token ids and each token's document index."""

  def __init__(self, tokens: np.ndarray, doc_ids: np.ndarray):
    if tokens.shape != doc_ids.shape or tokens.ndim != 1:
      raise ValueError(f"tokens {tokens.shape} and doc_ids {doc_ids.shape} must be equal 1-D")
    self.tokens = tokens
    self.doc_ids = doc_ids

  @property
  def num_tokens(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def num_documents(self) -> int:
    return int(self.doc_ids[-1]) + 1 if self.num_tokens else 0

  def num_windows(self, seq_len: int) -> int:
    # Window i needs tokens up to i*L + L inclusive.
    return max(0, (self.num_tokens - 1) // seq_len)

  def window(self, i: int, seq_len: int) -> dict[str, np.ndarray]:
    if not 0 <= i < self.num_windows(seq_len):
      raise IndexError(f"window {i} out of range [0, {self.num_windows(seq_len)})")
    sl = slice(i * seq_len, i * seq_len + seq_len + 1)
    return make_example(self.tokens[sl], self.doc_ids[sl])


def pack_documents(docs: Sequence[str], tokenizer) -> PackedStream:
  """Tokenize `docs` (eos after each) into one stream.

  Uses `tokenizer.encode_batch` (list of arrays) when the tokenizer has it, else `encode`.
  """
  if hasattr(tokenizer, "encode_batch"):
    pieces = tokenizer.encode_batch(list(docs))
  else:
    pieces = [np.asarray(tokenizer.encode(d), dtype=np.int32) for d in docs]
  eos = np.array([tokenizer.eos_id], dtype=np.int32)
  lengths = np.array([len(p) + 1 for p in pieces], dtype=np.int64)
  parts = []
  for p in pieces:
    parts += [np.asarray(p, dtype=np.int32), eos]
  tokens = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
  # The eos belongs to the document it ends, so a document's last word still learns to
  # predict eos; only eos -> next document's first token is masked.
  doc_ids = np.repeat(np.arange(len(pieces), dtype=np.int32), lengths)
  return PackedStream(tokens, doc_ids)


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
