"""`jaxpar serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

One background thread drives the continuous-batching engine; each HTTP request submits a
prompt and receives its tokens through an asyncio queue. Streams are server-sent events
in OpenAI's format, ending with `data: [DONE]`. The queue of waiting requests is bounded
(429 beyond it); a client that disconnects cancels its request, freeing its slot; SIGTERM
stops new requests, lets the running ones finish (or cancels them after a grace period)
and exits 0.
"""

import asyncio
import contextlib
import json
import os
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from jaxpar.inference import openai_api as api
from jaxpar.inference.chat import TemplateError, render_chat
from jaxpar.inference.sampling import SamplingParams


class EngineWorker:
  """Runs `engine.step()` on its own thread while there is work; idles otherwise."""

  def __init__(self, engine):
    self.engine = engine
    self._wake = threading.Event()
    self._stop = False
    self.failure: str | None = None
    self._thread = threading.Thread(target=self._run, name="jaxpar-engine", daemon=True)
    self._thread.start()

  def submit(self, ids, sampling, on_event):
    request = self.engine.submit(ids, sampling, on_event)
    self._wake.set()
    return request

  def cancel(self, request):
    self.engine.cancel(request)
    self._wake.set()

  def _run(self):
    while not self._stop:
      if not self.engine.has_work:
        self._wake.wait(0.5)
        self._wake.clear()
        continue
      try:
        self.engine.step()
      except Exception as e:  # noqa: BLE001  the requests in flight fail; the server goes on
        self.failure = f"the engine failed: {type(e).__name__}: {e}"
        for request in self.engine.reset():
          if request.on_event is not None:
            request.on_event(e)

  def close(self, grace_s: float):
    """Let running requests finish for up to grace_s, then cancel what is left."""
    deadline = time.monotonic() + grace_s
    while self.engine.has_work and time.monotonic() < deadline and self._thread.is_alive():
      time.sleep(0.05)
    for request in [*self.engine.waiting, *(r for r in self.engine.slots if r)]:
      self.cancel(request)
    time.sleep(0.1)
    self._stop = True
    self._wake.set()
    self._thread.join(timeout=10)


def build_app(engine, *, model_name: str, max_queue: int = 64, grace_s: float = 30.0) -> FastAPI:
  """The ASGI app serving `engine` as model `model_name`."""
  state = {"worker": None, "draining": False}

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    state["worker"] = EngineWorker(engine)
    yield
    state["draining"] = True
    await asyncio.to_thread(state["worker"].close, grace_s)

  app = FastAPI(title="jaxpar", lifespan=lifespan)

  @app.exception_handler(api.APIError)
  async def _api_error(_request, error: api.APIError):
    return JSONResponse(error.body(), status_code=error.status)

  @app.get("/health")
  async def health():
    if state["draining"] or state["worker"] is None:
      return JSONResponse({"status": "unavailable"}, status_code=503)
    return {"status": "ok", "waiting": engine.pending, "slots": len(engine.slots),
            "busy_slots": sum(r is not None for r in engine.slots)}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                        "owned_by": "jaxpar", "max_model_len": engine.max_seq_len}]}

  @app.post("/v1/completions")
  async def completions(request: Request):
    body = api.parse(api.CompletionRequest, await _json(request))
    prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
    ids = _encode(engine, prompt)
    return await _respond(body, ids, chat=False, logprobs=body.logprobs is not None)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body = api.parse(api.ChatRequest, await _json(request))
    tokenizer = engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
      raise api.APIError(400, f"model {model_name!r} has no chat template: use /v1/completions, or add a "
                         "chat_template to its tokenizer_config.json", param="messages")
    try:
      text = render_chat(tokenizer.chat_template, [{"role": m.role, "content": m.text()} for m in body.messages],
                         bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    except TemplateError as e:
      raise api.APIError(400, str(e), param="messages") from None
    return await _respond(body, tokenizer.encode(text), chat=True, logprobs=body.logprobs)

  async def _respond(body, ids, *, chat: bool, logprobs: bool):
    if body.model != model_name:
      raise api.APIError(404, f"the model '{body.model}' does not exist: this server serves '{model_name}'",
                         param="model", code="model_not_found")
    if state["draining"]:
      raise api.APIError(503, "the server is shutting down", kind="server_error")
    sampling = _sampling(engine, body, ids, chat=chat, logprobs=logprobs)
    if engine.pending >= max_queue:
      raise api.APIError(429, f"too many requests waiting ({engine.pending}): retry later",
                         kind="rate_limit_exceeded", code="queue_full")
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    handle = state["worker"].submit(ids, sampling, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    request_id = api.new_id("chatcmpl" if chat else "cmpl")
    if body.stream:
      include_usage = bool(body.stream_options and body.stream_options.include_usage)
      return StreamingResponse(_stream(handle, events, request_id, len(ids), chat, logprobs, include_usage),
                               media_type="text/event-stream")
    try:
      event = await events.get()
      while not isinstance(event, Exception) and event.finish_reason is None:
        event = await events.get()
    finally:
      state["worker"].cancel(handle)  # a client gone mid-request frees its slot; a no-op once done
    if isinstance(event, Exception):
      raise api.APIError(500, state["worker"].failure, kind="server_error")
    done = handle.completion()
    block = _logprobs(engine, done.tokens, done.logprobs, chat) if logprobs else None
    choice = api.completion_choice(done.text, done.finish_reason, block, chat=chat)
    return api.envelope(request_id, model_name, [choice], chat=chat,
                        usage_counts=api.usage(len(ids), len(done.tokens)))

  async def _stream(handle, events, request_id, prompt_tokens, chat, logprobs, include_usage):
    def sse(payload) -> str:
      return f"data: {json.dumps(payload)}\n\n"
    try:
      if chat:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        yield sse(api.envelope(request_id, model_name, [first], chat=True, chunk=True))
      while True:
        event = await events.get()
        if isinstance(event, Exception):
          error = api.APIError(500, state["worker"].failure, kind="server_error")
          yield sse(error.body())
          break
        block = (_logprobs(engine, [event.token], [event.logprob], chat)
                 if logprobs and event.token is not None and event.text else None)
        if event.text or event.finish_reason:
          choice = api.completion_choice(event.text, event.finish_reason, block, chat=chat, delta=True)
          yield sse(api.envelope(request_id, model_name, [choice], chat=chat, chunk=True))
        if event.finish_reason:
          break
      if include_usage:
        yield sse(api.envelope(request_id, model_name, [], chat=chat, chunk=True,
                               usage_counts=api.usage(prompt_tokens, len(handle.generated))))
      yield "data: [DONE]\n\n"
    finally:
      state["worker"].cancel(handle)  # the client left mid-stream: free the slot

  return app


async def _json(request: Request):
  raw = await request.body()
  try:
    return json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError):
    raise api.APIError(400, "could not parse the JSON body of your request: send valid JSON") from None


def _encode(engine, prompt) -> list[int]:
  if isinstance(prompt, str) and not prompt:
    raise api.APIError(400, "the prompt is empty", param="prompt")
  try:
    ids = engine.encode(prompt)
  except (TypeError, ValueError) as e:
    raise api.APIError(400, f"invalid prompt: {e}", param="prompt") from None
  vocab = engine.runtime.model_config.vocab_size
  if not ids or min(ids) < 0 or max(ids) >= vocab:
    raise api.APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
  return ids


def _sampling(engine, body, ids, *, chat: bool, logprobs: bool) -> SamplingParams:
  limit = engine.max_seq_len
  requested = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
  room = limit - len(ids)
  if room < 1:
    raise api.APIError(400, f"This model's maximum context length is {limit} tokens. However, your "
                       f"prompt has {len(ids)} tokens: shorten it", param="messages" if chat else "prompt",
                       code="context_length_exceeded")
  if requested is not None and not 1 <= requested <= room:
    raise api.APIError(400, f"max_tokens={requested} is out of range: this model's maximum context length "
                       f"is {limit} tokens and the prompt has {len(ids)}, so use 1 to {room}",
                       param="max_tokens", code="context_length_exceeded" if requested > room else None)
  seed = body.seed if body.seed is not None else int.from_bytes(os.urandom(4), "little")
  return SamplingParams(max_tokens=requested or room, temperature=body.temperature, top_k=body.top_k,
                        top_p=body.top_p, seed=seed % 2 ** 32, stop=body.stops(), logprobs=logprobs)


def _logprobs(engine, tokens, logprobs, chat):
  texts = [engine.tokenizer.decode([t]) for t in tokens]
  return api.logprobs_block(texts, list(logprobs), chat=chat)


def serve(engine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64,
          grace_s: float = 30.0, log_level: str = "info"):
  """Serve until SIGTERM / Ctrl-C (uvicorn stops taking requests and drains)."""
  import uvicorn

  from jaxpar.cluster.preemption import stop_on_signals
  app = build_app(engine, model_name=model_name, max_queue=max_queue, grace_s=grace_s)
  # After draining, uvicorn re-raises the signal to the handler that was there before it;
  # ours only records it, so a drained server exits 0 instead of dying by the signal.
  with stop_on_signals():
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace_s + 5)
