"""Chat fine-tuning batches (data.format=chat): examples packed whole into rows, with segment ids
and loss weights.

Packing is first-fit: each example (its tokens, shuffled once by data.shuffle_seed) goes into
the first row with room for it, else a new row; examples are never split, and one longer
than a row is cut to data.seq_len + 1 tokens (counted in `truncated`). An example of n tokens
takes n - 1 positions (inputs t[:-1], targets t[1:]); its own segment id keeps attention
inside it, its positions count from 0, and the loss weight of target t[j] is 1 where t[j] is
an assistant (completion) token, else 0. Padding has segment 0 and weight 0. The train step
divides the summed loss by the summed weights, so the reported loss is per assistant token,
and a packed row gives the same sums as its examples one per row.

`ChatBatches` repeats the packed rows endlessly in a seeded order per epoch; its state is the
next row, as TrainBatches' is the next sample.
"""

import functools
import os

import numpy as np

from jaxpar.data.chat import ChatRenderer, example_tokens
from jaxpar.data.loader import KEYS, _globalize, _process_rows
from jaxpar.data.readers import read_records
from jaxpar.data.sources import bundled_path, source_files
from jaxpar.errors import ConfigError, DataError


def pack_examples(examples, seq_len: int) -> tuple[dict, int]:
  """[(tokens [n], assistant mask [n])] -> ({key: [rows, seq_len]} in KEYS, examples truncated)."""
  rows, room, truncated = [], [], 0
  for tokens, mask in examples:
    if len(tokens) > seq_len + 1:
      tokens, mask, truncated = tokens[:seq_len + 1], mask[:seq_len + 1], truncated + 1
    size = len(tokens) - 1
    if size < 1 or not mask[1:].any():
      continue  # nothing to learn from
    row = next((i for i, free in enumerate(room) if free >= size), None)
    if row is None:
      rows.append([])
      room.append(seq_len)
      row = len(rows) - 1
    rows[row].append((tokens, mask))
    room[row] -= size
  packed = {k: np.zeros((len(rows), seq_len), np.float32 if k == "loss_mask" else np.int32) for k in KEYS}
  for r, row in enumerate(rows):
    at = 0
    for segment, (tokens, mask) in enumerate(row, start=1):
      n = len(tokens) - 1
      packed["inputs"][r, at:at + n] = tokens[:-1]
      packed["targets"][r, at:at + n] = tokens[1:]
      packed["loss_mask"][r, at:at + n] = mask[1:]
      packed["segment_ids"][r, at:at + n] = segment
      packed["positions"][r, at:at + n] = np.arange(n)
      at += n
  return packed, truncated


def read_rows(spec: str) -> list[dict]:
  """The rows of a data source: JSON lines (compressed too), Parquet or Arrow files, a folder
  (a `datasets` one included) or a glob of them, read as pre-training data is."""
  rows = [row for path in source_files(spec) for row in read_records(path)]
  if not rows:
    raise DataError(f"data.source={spec!r} holds no rows")
  return rows


def chat_template_text(name: str | None, tokenizer) -> str | None:
  """A chat template's Jinja source: `name` a .jinja file, or `chatml` (the bundled ChatML
  template, with {% generation %} markers); no name: the tokenizer's own (None if it has none)."""
  if not name:
    return getattr(tokenizer, "chat_template", None)
  path = bundled_path("chatml.jinja") if name == "chatml" else name
  if not os.path.isfile(path):
    raise ConfigError(f"chat template {name!r} does not exist: give a .jinja file, or chatml")
  with open(path) as f:
    return f.read()


def chat_renderer(data_config, tokenizer, template: str | None = None) -> ChatRenderer:
  """The one renderer of chat prompts everywhere (SFT, RL, generate --chat, serve, export):
  `template` (a --chat-template), else the template data.chat_template names, else the
  tokenizer's own."""
  return ChatRenderer(chat_template_text(template or data_config.chat_template, tokenizer),
                      bos_token=getattr(tokenizer, "bos_token", ""), eos_token=getattr(tokenizer, "eos_token", ""))


class ChatBatches:
  """Endless global batches of packed fine-tuning rows: dict of [global_batch, seq_len] arrays."""

  def __init__(self, data_config, tokenizer, sharding=None):
    cfg = data_config
    self.tokenizer, self.sharding = tokenizer, sharding
    self.seq_len, self.global_batch_size, self.seed = cfg.seq_len, cfg.global_batch_size, cfg.shuffle_seed
    rows = read_rows(cfg.source)
    renderer = chat_renderer(cfg, tokenizer) if any("messages" in r for r in rows) else None
    order = np.random.default_rng(self.seed).permutation(len(rows))
    self.rows, self.truncated = pack_examples((example_tokens(rows[i], renderer, tokenizer) for i in order),
                                              self.seq_len)
    count = len(self.rows["inputs"])
    if count < self.global_batch_size:
      raise DataError(f"data.source={cfg.source!r} packs into {count} rows of data.seq_len={self.seq_len}, fewer "
                      f"than data.global_batch_size={self.global_batch_size}: use more examples or a smaller batch")
    self.assistant_tokens = int(self.rows["loss_mask"].sum())
    self._local = _process_rows(sharding, self.global_batch_size, self.seq_len)
    self._next = 0

  def _row(self, sample: int) -> int:
    """Which packed row global sample `sample` is: each epoch visits every row in its own order."""
    epoch, index = divmod(sample, len(self.rows["inputs"]))
    return int(self._order(epoch)[index])

  @functools.lru_cache(maxsize=2)
  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows["inputs"]))

  def __iter__(self):
    return self

  def __next__(self):
    picked = [self._row(self._next + int(r)) for r in self._local]
    self._next += self.global_batch_size
    local = {k: v[picked] for k, v in self.rows.items()}
    return _globalize(local, self.sharding, (self.global_batch_size, self.seq_len))

  def get_state(self) -> dict:
    return {"next_sample": self._next}

  def set_state(self, state: dict):
    self._next = int(np.asarray(state["next_sample"]))
