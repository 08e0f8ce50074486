"""Tokenizers: a byte-level one that needs no files, or a Hugging Face tokenizer.json."""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

# Names that tokenizer.json files commonly give their end-of-text token, most likely first.
_EOS_NAMES = (
  "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "<|eot_id|>",
  "[EOS]", "<|end|>",
)
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]")


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; then eos (256) and bos (257).

  No padding id: packed batches mark padding and document edges with segment ids.
  """

  eos_id = 256
  bos_id = 257
  vocab_size = 258

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def encode_array(self, text: str) -> np.ndarray:
    # One numpy view of the UTF-8 bytes: no Python loop, so megabytes take milliseconds.
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [self.encode_array(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    arr = np.asarray(ids if hasattr(ids, "__len__") else list(ids), dtype=np.int64).reshape(-1)
    # Special ids carry no bytes; a model may emit a cut-off UTF-8 sequence, so replace.
    return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", "replace")

  def __repr__(self) -> str:
    return f"ByteTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class HFTokenizer:
  """A `tokenizers.Tokenizer` from a tokenizer.json, with the eos id looked up once."""

  def __init__(self, path: str):
    from tokenizers import Tokenizer  # imported here so "byte" runs need no extra import

    self.path = path
    self._tok = Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._find(_EOS_NAMES)
    if self.eos_id is None:
      raise ValueError(
        f"tokenizer {path} has no end-of-text token (looked for {', '.join(_EOS_NAMES)}); "
        "add one as a special token when training it, e.g. special_tokens=['<|endoftext|>']"
      )
    self.bos_id = self._find(_BOS_NAMES)

  def _find(self, names: Sequence[str]) -> int | None:
    for name in names:
      tid = self._tok.token_to_id(name)
      if tid is not None:
        return tid
    return None

  def encode(self, text: str) -> list[int]:
    # No special tokens: packing adds eos itself, and a template's bos would repeat.
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encs]

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def __repr__(self) -> str:
    return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
  """`"byte"` for the byte-level tokenizer, or the path of a Hugging Face tokenizer.json."""
  if spec == "byte":
    return ByteTokenizer()
  path = os.path.expanduser(spec)
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(path):
    raise ValueError(
      f"data.tokenizer: no tokenizer file at {path!r}; use 'byte' or the path of a "
      "Hugging Face tokenizer.json"
    )
  return HFTokenizer(path)
