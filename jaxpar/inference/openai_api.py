"""The OpenAI API's request and response shapes, as `jaxpar serve` speaks them.

Requests are validated strictly: an unknown parameter, or one jaxpar cannot honour and
that would change the result (n > 1, penalties, logit_bias, echo, top alternatives in
logprobs), is a 400 naming it, never silently ignored.
"""

import secrets
import time

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
  """An error reply: HTTP status and OpenAI's {"error": {message, type, param, code}} body."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               kind: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
  model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
  include_usage: bool = False


class _Common(_Strict):
  model: str
  temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default: sampling
  top_p: float = Field(1.0, gt=0, le=1)
  top_k: int = Field(0, ge=0)  # an extension (vLLM has it too); 0: off
  seed: int | None = None
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  n: int = 1
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  user: str | None = None

  def unsupported(self) -> list[tuple[str, str]]:
    """(param, why) for settings jaxpar cannot honour."""
    found = []
    if self.n != 1:
      found.append(("n", "only n=1 is supported"))
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(self, name):
        found.append((name, f"{name} is not supported; leave it at 0"))
    if self.logit_bias:
      found.append(("logit_bias", "logit_bias is not supported"))
    return found

  def stops(self) -> tuple[str, ...]:
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
  prompt: str | list[int] | list[str]
  max_tokens: int | None = 16  # OpenAI's default for completions
  logprobs: int | None = None
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None

  def unsupported(self):
    found = super().unsupported()
    if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
      if len(self.prompt) != 1:
        found.append(("prompt", "one prompt per request is supported"))
    if self.echo:
      found.append(("echo", "echo is not supported"))
    if self.suffix:
      found.append(("suffix", "suffix is not supported"))
    if self.best_of not in (None, 1):
      found.append(("best_of", "only best_of=1 is supported"))
    if self.logprobs:
      found.append(("logprobs", "top alternatives are not reported: use logprobs=0 for the sampled tokens'"))
    return found


class ChatMessage(_Strict):
  role: str
  content: str | list[dict] | None = None
  name: str | None = None

  def text(self) -> str:
    if isinstance(self.content, list):
      return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
    return self.content or ""


class ChatRequest(_Common):
  messages: list[ChatMessage] = Field(min_length=1)
  max_tokens: int | None = None
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = None

  def unsupported(self):
    found = super().unsupported()
    if self.top_logprobs:
      found.append(("top_logprobs", "top alternatives are not reported: leave top_logprobs at 0"))
    return found


def parse(kind, body) -> BaseModel:
  """Validate a request body, or raise a 400 naming the first bad parameter."""
  if not isinstance(body, dict):
    raise APIError(400, "the request body must be a JSON object")
  try:
    request = kind.model_validate(body)
  except ValidationError as e:
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
      raise APIError(400, f"unknown parameter '{param}': it is not supported", param=param) from None
    if first["type"] == "missing":
      raise APIError(400, f"you must provide a '{param}' parameter", param=param) from None
    raise APIError(400, f"invalid value for '{param}': {first['msg']}", param=param) from None
  for param, why in request.unsupported():
    raise APIError(400, why, param=param)
  return request


def new_id(prefix: str) -> str:
  return f"{prefix}-{secrets.token_hex(12)}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(text: str, finish_reason, logprobs=None, *, chat: bool, delta: bool = False) -> dict:
  choice = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
  if not chat:
    choice["text"] = text
  elif delta:
    choice["delta"] = {"content": text} if text else {}
  else:
    choice["message"] = {"role": "assistant", "content": text}
  return choice


def envelope(request_id: str, model: str, choices: list, *, chat: bool, chunk: bool = False,
             usage_counts: dict | None = None) -> dict:
  kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
  body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
  if usage_counts is not None:
    body["usage"] = usage_counts
  return body


def logprobs_block(tokens: list[str], logprobs: list[float], *, chat: bool) -> dict:
  if chat:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in zip(tokens, logprobs)]}
  return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None,
          "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]}
