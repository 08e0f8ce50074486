"""Streaming text decodes only the newest tokens (`requests.IncrementalText`), yet equals
decoding every generated token at every step, for both ways Hugging Face tokenizers decode:
byte-level BPE (Llama 3) and SentencePiece-like pieces with byte fallback and a stripped
leading space (Llama 2)."""

import numpy as np
import pytest

from jaxpar.data.tokenizer import HFTokenizer
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
