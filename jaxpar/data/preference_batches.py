"""Preference pairs for DPO (jaxpar/objectives/dpo.py): rows of `prompt`, `chosen`, `rejected`.

`prompt` is text, or a list of {role, content} messages rendered with the chat template up to
the assistant's turn (data.chat_template, else the tokenizer's); each answer is text, followed
by eos. Each answer is its own row (prompt + answer, loss weight on the answer's tokens only,
padding after it); rows are not packed, so a pair's two rows line up. A batch of
data.global_batch_size pairs is 2 x that many rows: the chosen answers, then the rejected
ones in the same order. Pairs are drawn in a seeded order per epoch; the state is the next pair.
"""

import functools

import numpy as np

from jaxpar.data.chat import tokenize_pieces
from jaxpar.data.chat_batches import chat_renderer, pack_examples, read_rows
from jaxpar.data.loader import KEYS, _globalize, _process_rows
from jaxpar.errors import DataError


def pair_rows(row: dict, renderer, tokenizer, seq_len: int) -> dict:
  """One preference row -> {key: [2, seq_len]}: its chosen answer's row, then its rejected one's."""
  missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
  if missing:
    raise DataError(f"a preference row lacks {missing[0]!r}: give `prompt`, `chosen` and `rejected`")
  prompt = row["prompt"]
  if not isinstance(prompt, str):
    if renderer is None:
      raise DataError("a preference prompt is a list of messages but no chat template is set: "
                      "set data.chat_template or use a tokenizer with one")
    prompt = renderer.render(prompt, True)
  answers = []
  for key in ("chosen", "rejected"):
    tokens, mask = tokenize_pieces([(prompt, False), (row[key], True)], tokenizer)
    answers.append((np.append(tokens, np.int32(tokenizer.eos_id)), np.append(mask, True)))
  rows = [pack_examples([answer], seq_len) for answer in answers]
  if any(len(r[0]["inputs"]) != 1 or r[1] for r in rows):
    raise DataError(f"a preference pair does not fit data.seq_len={seq_len} (or has an empty answer): "
                    "raise data.seq_len or shorten the prompt")
  return {k: np.concatenate([r[0][k] for r in rows]) for k in KEYS}


class PreferenceBatches:
  """Endless global batches of preference pairs: dict of [2 * global_batch, seq_len] arrays."""

  def __init__(self, data_config, tokenizer, sharding=None):
    cfg = data_config
    self.tokenizer, self.sharding, self.seq_len, self.seed = tokenizer, sharding, cfg.seq_len, cfg.shuffle_seed
    self.pairs_per_batch = cfg.global_batch_size
    rows = read_rows(cfg.source)
    renderer = chat_renderer(cfg, tokenizer) if any(not isinstance(r.get("prompt"), str) for r in rows) else None
    pairs = [pair_rows(row, renderer, tokenizer, self.seq_len) for row in rows]
    if len(pairs) < self.pairs_per_batch:
      raise DataError(f"data.source={cfg.source!r} holds {len(pairs)} pairs, fewer than "
                      f"data.global_batch_size={self.pairs_per_batch}: use more pairs or a smaller batch")
    self.pairs = {k: np.stack([p[k] for p in pairs]) for k in KEYS}  # [pairs, 2, seq_len]
    self._local = _process_rows(sharding, 2 * self.pairs_per_batch, self.seq_len)
    self._next = 0

  @functools.lru_cache(maxsize=2)
  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs["inputs"]))

  def _pair(self, sample: int) -> int:
    epoch, index = divmod(sample, len(self.pairs["inputs"]))
    return int(self._order(epoch)[index])

  def __iter__(self):
    return self

  def __next__(self):
    b = self.pairs_per_batch
    picked = [(self._pair(self._next + int(r) % b), int(r) // b) for r in self._local]  # (pair, 0 chosen / 1 rejected)
    self._next += b
    local = {k: np.stack([v[p, side] for p, side in picked]) for k, v in self.pairs.items()}
    return _globalize(local, self.sharding, (2 * b, self.seq_len))

  def get_state(self) -> dict:
    return {"next_sample": self._next}

  def set_state(self, state: dict):
    self._next = int(np.asarray(state["next_sample"]))
