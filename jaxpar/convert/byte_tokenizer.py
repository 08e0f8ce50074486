"""jaxpar's byte-level tokenizer as Hugging Face files, so an exported byte-level model
loads with `AutoTokenizer` and encodes exactly as `jaxpar.data.ByteTokenizer` does.

Ids 0..255 are the UTF-8 bytes and 256, 257 the end and start of text. As a tokenizer.json:
a BPE model with no merges whose vocabulary is only the 256 byte tokens (`<0x00>` ...),
with byte fallback, so every character becomes the tokens of its UTF-8 bytes; the special
tokens are never matched inside text (`split_special_tokens`), as the byte tokenizer
reads `<|endoftext|>` in a prompt as its 13 bytes.
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models


EOS, BOS = "<|endoftext|>", "<|startoftext|>"


def byte_tokenizer() -> Tokenizer:
  vocab = {f"<0x{b:02X}>": b for b in range(256)}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
  tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
  tokenizer.add_special_tokens([AddedToken(EOS, special=True), AddedToken(BOS, special=True)])  # 256, 257
  return tokenizer


def write_byte_tokenizer(directory) -> list[str]:
  """tokenizer.json and tokenizer_config.json for the byte tokenizer in `directory`."""
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  byte_tokenizer().save(str(directory / "tokenizer.json"))
  settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": BOS,
              "add_bos_token": False, "split_special_tokens": True,  # prompts start with their text
              "model_max_length": 2 ** 31 - 1}
  (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
  return ["tokenizer.json", "tokenizer_config.json"]
