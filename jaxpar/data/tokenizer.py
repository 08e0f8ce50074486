"""Tokenizers: a byte-level one that needs no files, or a Hugging Face tokenizer.json."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from jaxpar.errors import DataError

# Names that tokenizer.json files commonly give their end-of-text token, most likely first.
_EOS_NAMES = (
  "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "<|eot_id|>",
  "[EOS]", "<|end|>",
)
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]")
# Hugging Face files that travel with a model: the tokenizer, its settings (eos/bos, the
# chat template) and the generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


class ByteTokenizer:
  """UTF-8 bytes are ids 0..255; then eos (256) and bos (257).

  No padding id: packed batches mark padding and document edges with segment ids.
  """

  eos_id = 256
  bos_id = 257
  vocab_size = 258
  chat_template = None
  bos_token = eos_token = ""  # no text form: chat templates cannot write them

  def encode(self, text: str) -> list[int]:
    return self.encode_array(text).tolist()

  def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """A generation prompt: its bytes (no special tokens: prompts start with their text)."""
    return self.encode(text)

  def token_text(self, token: int) -> str:
    return self.decode([token]) if token < 256 else ("<eos>" if token == self.eos_id else "<bos>")

  def encode_array(self, text: str) -> np.ndarray:
    # One numpy view of the UTF-8 bytes: no Python loop, so megabytes take milliseconds.
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    return [self.encode_array(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    # Special ids carry no bytes; a model may emit a cut-off UTF-8 sequence, so replace.
    if isinstance(ids, list) and len(ids) < 256:
      # Generation decodes a few new ids per row and step: 0.6 us this way, 3.2 through
      # NumPy (0.2 ms of each batch-32 step); NumPy is the faster for long texts.
      return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace")
    arr = np.asarray(ids if hasattr(ids, "__len__") else list(ids), dtype=np.int64).reshape(-1)
    return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", "replace")

  def __repr__(self) -> str:
    return f"ByteTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class HFTokenizer:
  """A `tokenizers.Tokenizer` from a tokenizer.json, with the eos id looked up once.

  A tokenizer_config.json beside it (as Hugging Face models ship) names the eos and bos
  tokens and the chat template (also read from chat_template.jinja). Prompts get the special
  tokens that `transformers` gives them: those of the tokenizer.json's own post-processor
  (Llama 3 adds `<|begin_of_text|>` there). A config's `add_bos_token` / `add_eos_token`,
  which transformers 5 ignores once a tokenizer.json exists and its Llama 2 fast tokenizer
  followed before, adds the BOS / EOS only where the post-processor did not: shipped files,
  whose two settings agree, get the same ids either way, and none gets a second BOS.
  """

  def __init__(self, path: str):
    from tokenizers import Tokenizer  # imported here so "byte" runs need no extra import

    self.path = path
    self._tok = Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    settings = _read_json(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
    self.chat_template = settings.get("chat_template") or _read_text(
        os.path.join(os.path.dirname(path), "chat_template.jinja"))
    named = [_token_name(settings.get("eos_token"))]
    self.eos_id = self._find([n for n in named if n] + list(_EOS_NAMES))
    if self.eos_id is None:
      raise DataError(
        f"tokenizer {path} has no end-of-text token (looked for {', '.join(_EOS_NAMES)}); "
        "add one as a special token when training it, e.g. special_tokens=['<|endoftext|>']"
      )
    self.bos_id = self._find([n for n in [_token_name(settings.get("bos_token"))] if n] + list(_BOS_NAMES))
    # The special tokens as text, for chat templates that write them out.
    self.eos_token = self._tok.id_to_token(self.eos_id)
    self.bos_token = self._tok.id_to_token(self.bos_id) if self.bos_id is not None else ""
    self._add_bos = bool(settings.get("add_bos_token")) and self.bos_id is not None
    self._add_eos = bool(settings.get("add_eos_token"))

  def _find(self, names: Sequence[str]) -> int | None:
    for name in names:
      tid = self._tok.token_to_id(name)
      if tid is not None:
        return tid
    return None

  def encode(self, text: str) -> list[int]:
    # No special tokens: packing adds eos itself, and a template's bos would repeat.
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """A generation prompt, with the special tokens the tokenizer adds (see the class)."""
    ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
    if add_special_tokens and self._add_bos and ids[:1] != [self.bos_id]:
      ids = [self.bos_id] + ids
    if add_special_tokens and self._add_eos and ids[-1:] != [self.eos_id]:
      ids = ids + [self.eos_id]
    return ids

  def token_text(self, token: int) -> str:
    """One token as text (special tokens included), as logprobs report it."""
    return self._tok.decode([int(token)], skip_special_tokens=False)

  def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
    encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encs]

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

  def __repr__(self) -> str:
    return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _read_text(path: str) -> str | None:
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return f.read()


def _token_name(entry) -> str | None:
  """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
  return entry.get("content") if isinstance(entry, dict) else entry


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
  """`"byte"` for the byte-level tokenizer, or the path of a Hugging Face tokenizer.json."""
  if spec == "byte":
    return ByteTokenizer()
  path = os.path.expanduser(spec)
  if os.path.isdir(path):
    path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(path):
    raise DataError(
      f"data.tokenizer: no tokenizer file at {path!r}; use 'byte' or the path of a "
      "Hugging Face tokenizer.json"
    )
  return HFTokenizer(path)


def copy_tokenizer_files(source, target_dir) -> list[str]:
  """Copy a tokenizer into `target_dir` as Hugging Face lays it out: `source` is a model
  directory (its TOKENIZER_FILES are copied) or a tokenizer .json file (copied as
  tokenizer.json, with the settings files beside it)."""
  source, target = Path(source), Path(target_dir)
  folder = source if source.is_dir() else source.parent
  found = {name: folder / name for name in TOKENIZER_FILES if (folder / name).is_file()}
  if source.is_file():
    found["tokenizer.json"] = source
  if found:
    target.mkdir(parents=True, exist_ok=True)
    for name, path in found.items():
      shutil.copy2(path, target / name)
  return sorted(found)
