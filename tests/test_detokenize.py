"""Streaming text decodes only the newest tokens (`requests.IncrementalText`), yet equals
decoding every generated token at every step, for both ways Hugging Face tokenizers decode:
byte-level BPE (Llama 3) and SentencePiece-like pieces with byte fallback and a stripped
leading space (Llama 2)."""

import numpy as np
import pytest

from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer
from jaxpar.inference.requests import IncrementalText
from tests.serving_setup import train_tokenizer


@pytest.mark.parametrize("style", ["llama3", "llama2"])
def test_incremental_text_equals_decoding_everything_at_every_step(tmp_path, style):
  train_tokenizer(tmp_path, style)
  tokenizer = HFTokenizer(str(tmp_path / "tokenizer.json"))
  rng = np.random.default_rng(0)
  natural = list(tokenizer.encode("the quick brown fox jumps over the lazy dog {\"a\": [1, 2]} a fox runs"))
  unicode = list(tokenizer.encode(" ü€😀 the dog"))
  for trial in range(20):
    # Real text, random ids (specials, lone bytes of multi-byte characters included), or all three.
    noise = rng.integers(0, tokenizer.vocab_size, 60).tolist()
    tokens = [natural, noise, [*natural[:5], *noise[:20], *unicode, *natural[5:]]][trial % 3]
    text, generated = IncrementalText(), []
    for token in tokens:
      generated.append(int(token))
      assert text(generated, tokenizer.decode) == tokenizer.decode(generated), (trial, len(generated))
    if trial % 3 == 0:  # real text: each step decoded a few tokens, not all of them
      assert len(generated) - text.start <= 4


def test_byte_tokenizer_decodes_short_and_long_lists_alike():
  """Short lists (generation's newest tokens) take a pure-Python path, long ones NumPy's:
  both drop special ids and replace cut-off UTF-8 the same way."""
  tokenizer, rng = ByteTokenizer(), np.random.default_rng(0)
  text = list(" ü€😀 the dog".encode("utf-8"))
  for ids in ([], text, text[:3], [257, *text[:2], 256, 255, *text]):
    assert tokenizer.decode(ids) == tokenizer.decode(np.asarray(ids, np.int64)), ids
  noise = rng.integers(0, tokenizer.vocab_size, 600).tolist()
  for end in (5, 255, 256, 600):
    assert tokenizer.decode(noise[:end]) == tokenizer.decode(np.asarray(noise[:end])), end
  assert tokenizer.decode([*"ok".encode(), 0xE2, 0x82]) == "ok\ufffd"
