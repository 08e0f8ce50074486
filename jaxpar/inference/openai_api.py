"""The OpenAI API's request and response shapes, as `jaxpar serve` speaks them, with the
vLLM extensions that evaluation harnesses and load generators send.

Every field below is honoured. A field jaxpar does not know is ignored, as vLLM does: the
server logs one warning per field name and names the ignored fields in the
`x-jaxpar-ignored-fields` response header. A known field with a bad value is a 400 naming it.
"""

import secrets
import time
import typing

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jaxpar.inference.sampling import BOUNDS

IGNORED_HEADER = "x-jaxpar-ignored-fields"


class APIError(Exception):
  """An error reply: HTTP status and OpenAI's {"error": {message, type, param, code}} body."""

  def __init__(self, status: int, message: str, *, param: str | None = None,
               kind: str = "invalid_request_error", code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Lenient(BaseModel):
  model_config = ConfigDict(extra="allow", populate_by_name=True)


class StreamOptions(_Lenient):
  include_usage: bool = False
  continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchema(_Lenient):
  name: str = "response"
  schema_: dict = Field(default_factory=dict, alias="schema")
  description: str | None = None
  strict: bool | None = None


class ResponseFormat(_Lenient):
  type: typing.Literal["text", "json_object", "json_schema"]
  json_schema: JsonSchema | None = None


class StructuredOutputs(_Lenient):
  """vLLM's constraint fields (one of them)."""
  json_: dict | str | None = Field(None, alias="json")
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None


class _Common(_Lenient):
  model: str | None = None  # as vLLM: the served model when left out
  # Left out: the server's defaults, the run's train.sample_temperature and sample_top_p (as vLLM
  # takes a model's generation_config.json); OpenAI's (1, 1) for an engine served without a run.
  temperature: float | None = BOUNDS["temperature"].field(None)
  top_p: float | None = BOUNDS["top_p"].field(None)
  top_k: int = BOUNDS["top_k"].field(0)  # vLLM
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None  # vLLM: ends the text after one of these (as well as EOS)
  ignore_eos: bool = False  # vLLM: run on past the end-of-text token
  min_tokens: int = BOUNDS["min_tokens"].field(0)  # vLLM
  stream: bool = False
  stream_options: StreamOptions | None = None
  n: int = BOUNDS["n"].field(1)
  presence_penalty: float = BOUNDS["presence_penalty"].field(0.0)
  frequency_penalty: float = BOUNDS["frequency_penalty"].field(0.0)
  repetition_penalty: float = BOUNDS["repetition_penalty"].field(1.0)  # vLLM
  logit_bias: dict[int, float] | None = None
  user: str | None = None
  add_special_tokens: bool | None = None  # vLLM; default: True for completions, False for chat
  return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens "token_id:N", not by their text
  response_format: ResponseFormat | None = None
  structured_outputs: StructuredOutputs | None = None  # vLLM
  guided_json: dict | str | None = None  # vLLM's older names for structured_outputs
  guided_regex: str | None = None
  guided_choice: list[str] | None = None
  guided_grammar: str | None = None
  # jaxpar: take the draft tokens of the server's --speculative source (left out: its default).
  speculative: bool | None = None

  def stops(self) -> tuple[str, ...]:
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

  def constraints(self) -> list[tuple[str, object, str]]:
    """(kind, value, field) of each constraint asked for (`grammar.constraint`'s kinds)."""
    found = []
    if self.response_format is not None and self.response_format.type == "json_object":
      found.append(("json_object", None, "response_format"))
    elif self.response_format is not None and self.response_format.type == "json_schema":
      if self.response_format.json_schema is None:
        raise APIError(400, "response_format: type json_schema needs a json_schema", param="response_format")
      found.append(("json", self.response_format.json_schema.schema_, "response_format.json_schema"))
    outputs = self.structured_outputs or StructuredOutputs()
    for kind, value, field in (("json", outputs.json_, "structured_outputs.json"),
                               ("regex", outputs.regex, "structured_outputs.regex"),
                               ("choice", outputs.choice, "structured_outputs.choice"),
                               ("grammar", outputs.grammar, "structured_outputs.grammar"),
                               ("json", self.guided_json, "guided_json"), ("regex", self.guided_regex, "guided_regex"),
                               ("choice", self.guided_choice, "guided_choice"),
                               ("grammar", self.guided_grammar, "guided_grammar")):
      if value is not None:
        found.append((kind, value, field))
    if len(found) > 1:
      raise APIError(400, f"give one constraint, not {len(found)}: {', '.join(f for *_, f in found)}",
                     param=found[1][2])
    return found


class CompletionRequest(_Common):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = BOUNDS["max_tokens"].field(16)  # OpenAI's default; 0 with echo scores the prompt
  logprobs: int | None = BOUNDS["top_logprobs"].field(None)
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None

  def checks(self):
    if self.suffix:
      raise APIError(400, "suffix is not supported: leave it out", param="suffix")
    if self.best_of not in (None, self.n):
      raise APIError(400, f"best_of={self.best_of} must equal n={self.n}", param="best_of")
    if not self.prompt or (isinstance(self.prompt[0], list) and not all(self.prompt)):
      raise APIError(400, "the prompt is empty", param="prompt")


class ChatMessage(_Lenient):
  role: str
  content: str | list[dict] | None = None
  name: str | None = None

  def text(self) -> str:
    if isinstance(self.content, list):
      return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
    return self.content or ""


class ChatRequest(_Common):
  messages: list[ChatMessage] = Field(min_length=1)
  # A chat answer has at least one token (OpenAI's rule for both names).
  max_tokens: int | None = Field(None, ge=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = BOUNDS["top_logprobs"].field(None)
  add_generation_prompt: bool = True  # vLLM: end the prompt where the assistant's answer starts

  def checks(self):
    if self.top_logprobs and not self.logprobs:
      raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


class TokenizeRequest(_Lenient):
  """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""
  model: str | None = None
  prompt: str | None = None
  messages: list[ChatMessage] | None = None
  add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
  add_generation_prompt: bool = True
  return_token_strs: bool = False

  def checks(self):
    if (self.prompt is None) == (self.messages is None):
      raise APIError(400, "give a 'prompt' or 'messages' (one of them)", param="prompt")


class DetokenizeRequest(_Lenient):
  model: str | None = None
  tokens: list[int]

  def checks(self):
    pass


def accepted_fields(kind) -> list[str]:
  """Every field a request of `kind` may carry (nested ones as parent.child)."""
  names = []
  for name, field in kind.model_fields.items():
    names.append(field.alias or name)
    inner = _model_of(field.annotation)
    if inner is not None and inner is not ChatMessage:
      names += [f"{field.alias or name}.{child}" for child in accepted_fields(inner)]
  return names


def _model_of(annotation):
  """The BaseModel class inside an annotation like `X | None` or `list[X]`, if any."""
  if isinstance(annotation, type) and issubclass(annotation, BaseModel):
    return annotation
  for arg in typing.get_args(annotation):
    if (found := _model_of(arg)) is not None:
      return found
  return None


def _ignored(model: BaseModel, prefix: str = "") -> list[str]:
  """Names of the fields a parsed request carried that jaxpar does not know."""
  found = [prefix + name for name in (model.model_extra or {})]
  for name in type(model).model_fields:
    value = getattr(model, name)
    for item in value if isinstance(value, list) else [value]:
      if isinstance(item, BaseModel):
        found += _ignored(item, f"{prefix}{name}.")
  return sorted(set(found))


def _param(kind, loc) -> str:
  """The request field an error location points at (union branches and list indices skipped)."""
  path, model = [], kind
  for part in loc:
    if model is None or not isinstance(part, str):
      continue
    field = next(((name, f) for name, f in model.model_fields.items() if part in (name, f.alias)), None)
    if field is not None:  # else a union branch's tag ("str", "list[int]")
      path.append(field[1].alias or field[0])
      model = _model_of(field[1].annotation)
  return ".".join(path) or str(loc[0])


def parse(kind, body) -> tuple[BaseModel, list[str]]:
  """Validate a request body -> (request, names of the fields ignored), or raise a 400
  naming the first bad field."""
  if not isinstance(body, dict):
    raise APIError(400, "the request body must be a JSON object")
  try:
    request = kind.model_validate(body)
  except ValidationError as e:
    first = e.errors()[0]
    param = _param(kind, first["loc"])
    if first["type"] == "missing":
      raise APIError(400, f"you must provide a '{param}' parameter", param=param) from None
    raise APIError(400, f"invalid value for '{param}': {first['msg']}", param=param) from None
  request.checks()
  return request, _ignored(request)


def new_id(prefix: str) -> str:
  return f"{prefix}-{secrets.token_hex(12)}"


def speculative_usage(proposed: int, accepted: int, rounds: int) -> dict:
  """jaxpar's usage extension under speculative decoding: draft tokens proposed and kept, the
  target passes taken, and the mean draft tokens kept per pass."""
  return {"proposed_tokens": proposed, "accepted_tokens": accepted, "target_passes": rounds,
          "mean_accepted_length": accepted / rounds if rounds else 0.0}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def envelope(request_id: str, model: str, choices: list, *, chat: bool, chunk: bool = False,
             usage_counts: dict | None = None) -> dict:
  kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
  body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
  if usage_counts is not None:
    body["usage"] = usage_counts
  return body


def choice(index: int, text: str, finish_reason, logprobs=None, *, chat: bool, delta: bool = False) -> dict:
  body = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
  if not chat:
    body["text"] = text
  elif delta:
    body["delta"] = {"content": text} if text else {}
  else:
    body["message"] = {"role": "assistant", "content": text}
  return body


def completion_logprobs(texts: list[str], logprobs: list, tops: list, offset: int = 0) -> dict:
  """The completions API's logprobs block. tops: per token, {text: logprob} or None."""
  offsets, at = [], offset
  for text in texts:
    offsets.append(at)
    at += len(text)
  return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(texts: list[str], logprobs: list[float], tops: list) -> dict:
  """The chat API's logprobs block. tops: per token, [(text, logprob)]."""
  entry = lambda t, lp: {"token": t, "logprob": lp, "bytes": list(t.encode())}  # noqa: E731
  return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                      for t, lp, top in zip(texts, logprobs, tops)]}
