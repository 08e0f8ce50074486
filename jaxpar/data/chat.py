"""Supervised fine-tuning examples: a conversation rendered with the tokenizer's chat template,
tokenized, and each token marked as the assistant's (trained on) or not (context only).

Where the assistant's text is, the template tells in one of two ways:
- `{% generation %} ... {% endgeneration %}` around the assistant's turns (Hugging Face's
  convention for `return_assistant_tokens_mask`): the render marks those spans;
- else by rendering prefixes: for each assistant turn i, render(messages[:i], generation
  prompt) must be a prefix of render(messages[:i+1]), which must be a prefix of the whole
  render; the text between the two is the assistant's (its end-of-turn token included, so
  the model learns to stop). A template for which this fails gives no way to tell: a DataError.
The rendered text is tokenized piece by piece at those edges, so every token is wholly one
side's. Prompt/completion pairs are `prompt + completion + eos`, the completion trained on.
"""

import re

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxpar.errors import DataError

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a generation block's output
_PROBE = "\ue002"  # a private-use answer, to find what the template writes after an answer
_HAS_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class _Generation(Extension):
  """`{% generation %}body{% endgeneration %}`: the body, between two marker characters."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

  def _mark(self, caller):
    return _OPEN + caller() + _CLOSE


def _raise(message):
  raise DataError(f"the chat template refused a conversation: {message}")


def _environment():
  environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation])
  environment.globals["raise_exception"] = _raise
  return environment


class ChatRenderer:
  """A chat template (Jinja source) with the tokenizer's bos/eos text, rendering conversations
  into (text, is_assistant) pieces."""

  def __init__(self, template: str | None, *, bos_token: str = "", eos_token: str = ""):
    if not template:
      raise DataError("data.format=chat needs a chat template: the tokenizer has none (tokenizer_config.json "
                      "chat_template or chat_template.jinja); set data.chat_template to a .jinja file")
    try:
      self.template = _environment().from_string(template)
    except jinja2.TemplateError as e:
      raise DataError(f"the chat template does not parse: {e}") from None
    self.source = template
    self.marked = bool(_HAS_GENERATION.search(template))
    self.special = {"bos_token": bos_token, "eos_token": eos_token}

  def render(self, messages, add_generation_prompt: bool) -> str:
    """The conversation's text as the template writes it."""
    return self._render(messages, add_generation_prompt).replace(_OPEN, "").replace(_CLOSE, "")

  def end_of_turn(self) -> str:
    """The text the template writes after an assistant's answer, without surrounding
    whitespace (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`; "" if none): where a chat
    answer stops."""
    text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}], False)
    return text[text.index(_PROBE) + len(_PROBE):].strip() if _PROBE in text else ""

  def _render(self, messages, add_generation_prompt: bool) -> str:
    """The text with {% generation %} blocks between marker characters."""
    try:
      return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)
    except jinja2.TemplateError as e:
      raise DataError(f"the chat template failed on a conversation: {e}") from None

  def pieces(self, messages: list[dict]) -> list[tuple[str, bool]]:
    """The whole conversation's text as consecutive (text, is_assistant) pieces."""
    if self.marked:
      text = self._render(messages, False)
      parts = re.split(f"({_OPEN}|{_CLOSE})", text)
      pieces, inside = [], False
      for part in parts:
        if part in (_OPEN, _CLOSE):
          inside = part == _OPEN
        elif part:
          pieces.append((part, inside))
      return pieces
    whole = self.render(messages, False)
    pieces, done = [], 0
    for i, message in enumerate(messages):
      if message.get("role") != "assistant":
        continue
      prompt, turn = self.render(messages[:i], True), self.render(messages[:i + 1], False)
      if not (turn.startswith(prompt) and whole.startswith(turn) and len(prompt) >= done):
        raise DataError("the chat template has no {% generation %} markers and does not render each "
                        "conversation's prefixes as prefixes of the whole, so the assistant's tokens cannot be "
                        "told apart: use a template with {% generation %} blocks (data.chat_template)")
      pieces += [(whole[done:len(prompt)], False), (whole[len(prompt):len(turn)], True)]
      done = len(turn)
    pieces.append((whole[done:], False))
    return [(text, assistant) for text, assistant in pieces if text]


def tokenize_pieces(pieces, tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [n], assistant bool [n]) of (text, is_assistant) pieces, each tokenized alone."""
  ids = [np.asarray(tokenizer.encode(text), np.int32) for text, _ in pieces]
  marks = [np.full(len(x), assistant) for x, (_, assistant) in zip(ids, pieces)]
  return (np.concatenate(ids) if ids else np.zeros(0, np.int32),
          np.concatenate(marks) if marks else np.zeros(0, bool))


def example_tokens(row: dict, renderer: ChatRenderer | None, tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """One data row (`messages`, or `prompt` + `completion`) -> (tokens, assistant mask)."""
  if "messages" in row:
    if renderer is None:
      raise DataError("a row has `messages` but data.format is not chat: set data.format=chat")
    return tokenize_pieces(renderer.pieces(row["messages"]), tokenizer)
  if "prompt" in row and "completion" in row:
    tokens, mask = tokenize_pieces([(row["prompt"], False), (row["completion"], True)], tokenizer)
    return np.append(tokens, np.int32(tokenizer.eos_id)), np.append(mask, True)
  raise DataError(f"a fine-tuning row has keys {sorted(row)}: give `messages` (a list of {{role, content}}) "
                  "or `prompt` and `completion`")
