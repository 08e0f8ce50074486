"""How many bytes of UTF-8 text each token id stands for: what bits per byte divides by.

Bits per byte = summed cross-entropy (nats) / ln 2 / the bytes of text predicted, which
compares models with different tokenizers. Special tokens (eos) stand for no text.
  byte-level:      ids 0..255 are one byte each
  byte-level BPE:  (GPT-2 style, a ByteLevel decoder) each character of a token is one byte
  SentencePiece:   `<0xNN>` byte-fallback pieces are one byte; `▁` is a space
  other vocabularies: the UTF-8 length of the token's text
"""

import json

import numpy as np


def _uses_byte_level(decoder) -> bool:
  if not decoder:
    return False
  if decoder.get("type") == "ByteLevel":
    return True
  return any(_uses_byte_level(d) for d in decoder.get("decoders", []))


def _piece_bytes(token: str) -> int:
  if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
    return 1
  return len(token.replace("\u2581", " ").removeprefix("##").encode("utf-8"))


def byte_lengths(tokenizer) -> np.ndarray:
  """[vocab_size] float32: the bytes of text each token id decodes to."""
  path = getattr(tokenizer, "path", None)
  table = np.zeros(tokenizer.vocab_size, np.float32)
  if path is None:  # the byte-level tokenizer: 256 byte ids, then specials
    table[:256] = 1
    return table
  from tokenizers import Tokenizer
  raw = Tokenizer.from_file(path)
  byte_level = _uses_byte_level(json.loads(raw.to_str()).get("decoder"))
  for token, index in raw.get_vocab(with_added_tokens=False).items():
    table[index] = len(token) if byte_level else _piece_bytes(token)
  for index, added in raw.get_added_tokens_decoder().items():
    table[index] = 0 if added.special else len(added.content.encode("utf-8"))
  return table
