"""Structured output: a request's constraint (a JSON schema, any JSON object, a regex, one of
several strings, a Lark grammar) and, per request in flight, a matcher that says which
tokens may come next, as a bitmask the decode step applies on the device
(`processing.adjust`).

The grammar library is llguidance: it has no dependencies (xgrammar needs torch,
transformers and triton at run time), writes the bitmask straight into our numpy arrays,
covers JSON schema, regexes and Lark grammars in one engine, and computes each step's mask
on the fly in tens of microseconds, with no per-grammar index over the vocabulary to build
first (outlines-core builds one per regex, which takes seconds for large schemas and vocabularies).
"""

import functools
import json

import numpy as np

from jaxpar.inference.sampling import RequestError

# JSON without optional whitespace: a model that may emit spaces forever is held to compact output.
_JSON_OPTIONS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer, vocab: int):
  """llguidance's view of our tokenizer (its token bytes), padded to the model's vocabulary."""
  import llguidance
  source = getattr(tokenizer, "_tok", None)
  if source is not None:  # a Hugging Face tokenizer.json
    return llguidance.LLTokenizer(source.to_str(), n_vocab=vocab, eos_token=tokenizer.eos_id)
  specials = {tokenizer.eos_id, tokenizer.bos_id}  # the byte tokenizer

  class Bytes:
    eos_token_id, bos_token_id = tokenizer.eos_id, tokenizer.bos_id
    tokens = [bytes([i]) if i < 256 else b"" for i in range(tokenizer.vocab_size)]
    special_token_ids = sorted(specials)

    def __call__(self, text):
      return list(text if isinstance(text, bytes) else text.encode())
  return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()), n_vocab=vocab)


class Constraint:
  """A compiled constraint; `field` is the request field it came from (named in errors)."""

  def __init__(self, grammar: str, field: str, tokenizer, vocab: int):
    import llguidance
    self.field = field
    self._tokenizer = _ll_tokenizer(tokenizer, vocab)
    error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
    if error:
      raise RequestError(field, f"{field}: {error.splitlines()[0]}")
    self.grammar = grammar

  def matcher(self) -> "Matcher":
    import llguidance
    return Matcher(llguidance.LLMatcher(self._tokenizer, self.grammar, log_level=0), self._tokenizer.vocab_size)


class Matcher:
  """One request's position in its constraint."""

  def __init__(self, matcher, vocab: int):
    self._matcher = matcher
    self._mask = np.zeros(-(-vocab // 32), np.int32)  # llguidance's width: the tokenizer's vocabulary

  def fill_mask(self, row: np.ndarray):
    """Write the allowed next tokens into row (int32 bitmask words); ids past the tokenizer's
    vocabulary (a model's padding rows) are never allowed."""
    self._matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
    row[:len(self._mask)] = self._mask[:len(row)]
    row[len(self._mask):] = 0

  def masks_along(self, tokens, rows: np.ndarray) -> int:
    """Speculative decoding: the allowed tokens now and after each of `tokens` in turn, written
    into rows[0], rows[1], ... up to the first token not allowed -> how many are allowed. The
    matcher ends where it began."""
    self.fill_mask(rows[0])
    taken = 0
    for token in tokens:
      if not (rows[taken, token // 32] >> (token % 32)) & 1 or not self._matcher.consume_token(int(token)):
        break
      taken += 1
      self.fill_mask(rows[taken])
      if self._matcher.is_stopped():
        break
    if taken:
      self._matcher.rollback(taken)
    return taken

  def advance(self, token: int) -> bool:
    """Take a generated token; True once the constraint allows nothing more (or failed)."""
    self._matcher.consume_token(token)
    return self._matcher.is_stopped() or self._matcher.is_error()


def constraint(kind: str, value, field: str, tokenizer, vocab: int) -> Constraint:
  """kind: "json" (a schema, dict or string), "json_object", "regex", "choice" (list of
  strings) or "grammar" (Lark)."""
  import llguidance
  make = llguidance.LLMatcher
  if kind == "json":
    try:
      schema = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
      raise RequestError(field, f"{field} is not valid JSON: {e.msg}") from None
    if not isinstance(schema, (dict, bool)):
      raise RequestError(field, f"{field} must be a JSON schema object")
    grammar = make.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
  elif kind == "json_object":
    grammar = make.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
  elif kind == "regex":
    grammar = make.grammar_from_regex(value)
  elif kind == "choice":
    if not value or not all(isinstance(c, str) and c for c in value):
      raise RequestError(field, f"{field} must be a non-empty list of non-empty strings")
    grammar = make.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
  else:
    grammar = make.grammar_from_lark(value)
  return Constraint(grammar, field, tokenizer, vocab)
