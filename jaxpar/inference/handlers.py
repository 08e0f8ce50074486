"""From a parsed OpenAI request to engine requests and back: the prompts' token ids, each
choice's sampling settings, then one response or a stream of chunks.

A request with several prompts and `n` choices becomes prompts x n engine requests, which
the engine batches like any others; choice `i * n + j` is prompt i's j-th. With a `seed`,
choice j draws with seed + j, so the whole set is reproducible.
"""

import asyncio
import json
import os

from fastapi.responses import JSONResponse, StreamingResponse

from jaxpar.errors import DataError
from jaxpar.inference import grammar
from jaxpar.inference import openai_api as api
from jaxpar.inference.replicas import Replicas, load
from jaxpar.inference.requests import completion_room
from jaxpar.inference.sampling import RequestError, SamplingParams


class Call:
  """One HTTP request's engine requests, their events, and what the client asked to see."""

  def __init__(self, server, body, prompts: list[list[int]], *, chat: bool, headers: dict):
    self.server, self.body, self.prompts, self.chat, self.headers = server, body, prompts, chat, headers
    self.engine = server.engine
    self.echo = not chat and body.echo
    self.logprobs = body.logprobs if chat else body.logprobs is not None
    self.top = (body.top_logprobs or 0) if chat else (body.logprobs or 0)
    self.events: asyncio.Queue = asyncio.Queue()
    self.requests = []
    self.workers = []  # the worker of each request's replica
    self.retried = set()  # requests already moved to another replica after their engine failed
    self.id = api.new_id("chatcmpl" if chat else "cmpl")

  def submit(self):
    constraint = self._constraint()
    seed = self.body.seed if self.body.seed is not None else int.from_bytes(os.urandom(4), "little")
    try:
      for ids in self.prompts:
        for j in range(self.body.n):
          sampling = self._sampling(ids, (seed + j) % 2 ** 32, constraint)
          self.requests.append(self.engine.make_request(ids, sampling, self._listener(len(self.requests)),
                                                        self.server.adapter(self.body)))
    except RequestError as e:
      raise api.APIError(400, str(e), param=e.field) from None
    if (waiting := self.server.pending) + len(self.requests) > self.server.max_queue:
      raise api.APIError(429, f"too many requests waiting ({waiting}): retry later",
                         kind="rate_limit_exceeded", code="queue_full")
    n, replicas = self.body.n, self.server.replicas
    for i, ids in enumerate(self.prompts):  # a prompt's n choices share its pages: one replica
      self.server.metrics.admitted(len(ids) * n)
      worker = self.server.workers[replicas.pick(ids, self.requests[i * n].adapter)]
      self.workers += [worker] * n
      worker.enqueue(self.requests[i * n:(i + 1) * n])

  def _listener(self, index: int):
    loop, metrics = asyncio.get_running_loop(), self.server.metrics

    def on_event(event):
      if not isinstance(event, Exception):
        metrics.observe(self.requests[index], event)
      loop.call_soon_threadsafe(self.events.put_nowait, (index, event))
    return on_event

  def _constraint(self):
    found = self.body.constraints()
    if not found:
      return None
    kind, value, field = found[0]
    try:
      return grammar.constraint(kind, value, field, self.engine.tokenizer, self.engine.runtime.model_config.vocab_size)
    except RequestError as e:
      raise api.APIError(400, str(e), param=e.field) from None

  def _sampling(self, ids, seed: int, constraint) -> SamplingParams:
    body = self.body
    requested = (body.max_completion_tokens or body.max_tokens) if self.chat else body.max_tokens
    try:
      max_tokens = completion_room(len(ids), requested, self.engine.max_seq_len)
    except RequestError as e:
      param = ("messages" if self.chat else "prompt") if e.field == "prompt" else e.field
      raise api.APIError(400, str(e), param=param, code="context_length_exceeded") from None
    if body.speculative and self.engine.draft is None:
      raise api.APIError(400, "speculative: this server decodes without a draft source: leave the field out, "
                         "or serve with --speculative ngram (or draft=PATH)", param="speculative")
    eos = [] if body.ignore_eos else [self.engine.tokenizer.eos_id]
    stop = tuple(body.stops())
    if self.chat and not body.ignore_eos:  # the chat template's end of turn ends the answer
      eos += list(self.server.chat_stop_ids)
      stop += tuple(s for s in self.server.chat_stop if s not in stop)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=self.server.sampling["temperature"] if body.temperature is None else body.temperature,
        top_p=self.server.sampling["top_p"] if body.top_p is None else body.top_p,
        top_k=max(body.top_k, 0), seed=seed, stop=stop,
        stop_token_ids=tuple(dict.fromkeys(eos + list(body.stop_token_ids or []))), logprobs=bool(self.logprobs),
        top_logprobs=self.top, prompt_logprobs=self.top if self.echo and self.logprobs else None,
        min_tokens=body.min_tokens, logit_bias=tuple((body.logit_bias or {}).items()),
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, constraint=constraint,
        speculative=self.server.sampling.get("speculative", True) if body.speculative is None else body.speculative)

  @property
  def _model(self) -> str:
    """The model name answers carry: the adapter asked for, else the base's."""
    return self.server.adapter(self.body) or self.server.model_name

  def cancel(self):
    for request, worker in zip(self.requests, self.workers):
      worker.cancel(request)  # a no-op once finished

  def _retry(self, index: int) -> bool:
    """After request `index`'s engine failed: if nothing of it reached the client yet and
    another replica serves, queue it again there (once). False: the client gets the error."""
    request, replicas = self.requests[index], self.server.replicas
    if request.generated or index in self.retried or not isinstance(replicas, Replicas) or len(replicas) < 2:
      return False
    worker = min((w for w in self.server.workers if w is not self.workers[index]), key=lambda w: load(w.engine))
    again = worker.engine.make_request(request.prompt, request.sampling, self._listener(index),
                                       self.server.adapter(self.body))
    self.requests[index], self.workers[index] = again, worker
    self.retried.add(index)
    worker.enqueue([again])
    return True

  @staticmethod
  def failure(error: Exception):
    # 503: the engine failed and went on; a client may send the request again.
    return api.APIError(503, f"the engine failed: {type(error).__name__}: {error}", kind="server_error")

  # -- what the client sees -----------------------------------------------------------

  def _text(self, token: int) -> str:
    if self.body.return_tokens_as_token_ids:
      return f"token_id:{token}"
    return self.engine.tokenizer.token_text(token)

  def _logprobs(self, request, start: int, end: int, with_prompt: bool = False):
    """The logprobs block for request's generated tokens [start, end) (and its prompt)."""
    tokens, logprobs = request.generated[start:end], request.logprobs[start:end]
    tops = request.top_logprobs[start:end]
    if self.chat:
      return api.chat_logprobs([self._text(t) for t in tokens], logprobs,
                               [[(self._text(a), b) for a, b in top or []] for top in tops])
    tops = [{**{self._text(a): b for a, b in top or []}, self._text(t): lp} for t, lp, top in zip(tokens, logprobs, tops)]
    if with_prompt:
      tops = [None if top is None else {**{self._text(a): b for a, b in top}, self._text(t): lp}
              for t, lp, top in zip(request.prompt, request.prompt_logprobs, request.prompt_top_logprobs)] + tops
      tokens, logprobs = request.prompt + tokens, request.prompt_logprobs + logprobs
    return api.completion_logprobs([self._text(t) for t in tokens], logprobs, tops)

  def _usage(self) -> dict:
    counts = api.usage(sum(map(len, self.prompts)), sum(len(r.generated) for r in self.requests))
    # The prompt tokens the prefix cache supplied (as OpenAI's and vLLM's usage reports them).
    counts["prompt_tokens_details"] = {"cached_tokens": sum(r.prefix_hits for r in self.requests)}
    if self.engine.draft is not None:
      counts["speculative"] = api.speculative_usage(*(sum(getattr(r, k) for r in self.requests)
                                                      for k in ("proposed", "accepted", "rounds")))
    return counts

  async def respond(self):
    """The whole response, once every choice is done."""
    pending = set(range(len(self.requests)))
    try:
      while pending:
        index, event = await self.events.get()
        if isinstance(event, Exception):
          if self._retry(index):
            continue
          raise self.failure(event)
        if event.finish_reason is not None:
          pending.discard(index)
    finally:
      self.cancel()  # a client gone mid-request frees its slots
    choices = []
    for index, request in enumerate(self.requests):
      text = request.text
      if self.echo:
        text = self.engine.tokenizer.decode(request.prompt) + text
      block = self._logprobs(request, 0, len(request.generated), self.echo) if self.logprobs else None
      choices.append(api.choice(index, text, request.finish_reason, block, chat=self.chat))
    body = api.envelope(self.id, self._model, choices, chat=self.chat, usage_counts=self._usage())
    return JSONResponse(body, headers=self.headers)

  def stream(self):
    return StreamingResponse(self._chunks(), media_type="text/event-stream", headers=self.headers)

  async def _chunks(self):
    options = self.body.stream_options
    every = bool(options and options.continuous_usage_stats)
    reported = [0] * len(self.requests)  # tokens whose logprobs went out
    started = set()

    def sse(choices, usage=None) -> str:
      chunk = api.envelope(self.id, self._model, choices, chat=self.chat, chunk=True,
                           usage_counts=usage if usage is not None else (self._usage() if every else None))
      return f"data: {json.dumps(chunk)}\n\n"
    try:
      pending = set(range(len(self.requests)))
      while pending:
        index, event = await self.events.get()
        if isinstance(event, Exception):
          if self._retry(index):
            continue
          yield f"data: {json.dumps(self.failure(event).body())}\n\n"
          break
        request = self.requests[index]
        if index not in started:
          started.add(index)
          if self.chat:
            first = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                     "logprobs": None}
            yield sse([first])
          elif self.echo:
            block = self._logprobs(request, 0, 0, True) if self.logprobs else None
            yield sse([api.choice(index, self.engine.tokenizer.decode(request.prompt), None, block, chat=False)])
        if event.token is not None or event.finish_reason:  # a chunk per token, as vLLM (its text may be empty)
          block = None
          if self.logprobs:
            block, reported[index] = self._logprobs(request, reported[index], len(request.generated)), \
                len(request.generated)
          yield sse([api.choice(index, event.text, event.finish_reason, block, chat=self.chat, delta=True)])
        if event.finish_reason is not None:
          pending.discard(index)
      else:
        if self.body.stream_options and self.body.stream_options.include_usage:
          yield sse([], self._usage())
        yield "data: [DONE]\n\n"
    finally:
      self.cancel()  # the client left mid-stream: free the slots


def completion_prompts(server, body) -> list[list[int]]:
  """The prompts of a /v1/completions request as token ids: a string or a list of them
  (encoded with the tokenizer's special tokens unless add_special_tokens is false), token
  ids or a list of them (as given)."""
  prompt = body.prompt
  prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
  add = body.add_special_tokens is not False
  ids = [server.engine.encode(p, add) for p in prompts]
  vocab = server.engine.runtime.model_config.vocab_size
  for row in ids:
    if not row:
      raise api.APIError(400, "the prompt is empty", param="prompt")
    if min(row) < 0 or max(row) >= vocab:
      raise api.APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
  return ids


def chat_prompt(server, body) -> list[int]:
  """A chat's prompt ids: the chat template rendered (the run's, --chat-template, or the
  tokenizer's: `server.chat`), encoded with special tokens only if add_special_tokens (vLLM's
  default: no, the template writes them), and never with a second BOS when the template
  already wrote one."""
  if server.chat is None:
    raise api.APIError(400, f"model {body.model or server.model_name!r} has no chat template: use /v1/completions, "
                       "or serve with --chat-template FILE (or chatml)", param="messages")
  try:
    text = server.chat.render([{"role": m.role, "content": m.text()} for m in body.messages],
                              add_generation_prompt=body.add_generation_prompt)
  except DataError as e:
    raise api.APIError(400, str(e), param="messages") from None
  return encode_without_double_bos(server.engine.tokenizer, text, bool(body.add_special_tokens))


def encode_without_double_bos(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
  ids = tokenizer.encode_prompt(text, add_special_tokens)
  bos = getattr(tokenizer, "bos_id", None)
  if add_special_tokens and bos is not None and ids[:2] == [bos, bos]:
    ids = ids[1:]
  return ids
