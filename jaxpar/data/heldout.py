"""Held-out text as fixed windows: consecutive, non-overlapping and unpacked, so every token
of a window is predicted from the window's earlier tokens only and numbers from different
models (float, quantized weights, a quantized KV cache) compare exactly."""

import numpy as np

from jaxpar.errors import DataError


def split_heldout(documents: list[str], count: int) -> tuple[list[str], str]:
  """(training documents, held-out text): the last `count` documents are held out, so a
  model trained on the rest never saw them."""
  if not 0 < count < len(documents):
    raise DataError(f"cannot hold out {count} of {len(documents)} documents")
  return documents[:-count], "\n\n".join(documents[-count:])


def token_windows(text: str, tokenizer, seq_len: int, count: int | None = None) -> np.ndarray:
  """The first `count` (default: all) windows of seq_len + 1 tokens of `text`:
  [count, seq_len + 1] (inputs are [:, :-1], targets [:, 1:])."""
  tokens = np.asarray(tokenizer.encode(text), np.int32)
  available = (len(tokens) - 1) // seq_len
  count = available if count is None else count
  if count < 1 or count > available:
    raise DataError(f"the text has {len(tokens)} tokens: room for {available} windows of "
                     f"seq_len={seq_len}, not {count}")
  return np.stack([tokens[i * seq_len:(i + 1) * seq_len + 1] for i in range(count)])


def window_batch(windows: np.ndarray) -> dict:
  """Token windows [n, seq_len + 1] as a batch the losses take: inputs, targets, positions,
  one document per row, every target counted."""
  shape = (windows.shape[0], windows.shape[1] - 1)
  return {"inputs": windows[:, :-1], "targets": windows[:, 1:], "segment_ids": np.ones(shape, np.int32),
          "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape), "loss_mask": np.ones(shape)}
