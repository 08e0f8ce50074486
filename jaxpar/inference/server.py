"""`jaxpar serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

One background thread drives the continuous-batching engine (one per replica with
`--replicas N`, replicas.py routing each prompt; one for prefill and one for decode with
`--prefill-devices N`, disaggregated.py); each HTTP request submits its prompts and receives
their tokens through an asyncio queue (`handlers.py`). Streams are
server-sent events in OpenAI's format, ending with `data: [DONE]`. Besides
/v1/completions and /v1/chat/completions: /v1/models, /health, /metrics (Prometheus), and
vLLM's /tokenize, /detokenize and /tokenizer_info. The queue of waiting requests is bounded
(429 beyond it); a client that disconnects cancels its request, freeing its slot; SIGTERM
stops new requests, lets the running ones finish (or cancels them after a grace period)
and exits 0.
"""

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxpar.cluster.preemption import stop_on_signals
from jaxpar.data.chat import ChatRenderer
from jaxpar.errors import DataError
from jaxpar.inference import handlers
from jaxpar.inference import openai_api as api
from jaxpar.inference.disaggregated import Disaggregated
from jaxpar.inference.metrics import CONTENT_TYPE, ServingMetrics
from jaxpar.inference.replicas import Replicas

log = logging.getLogger("jaxpar.serve")
_warned: set[str] = set()  # unknown field names already logged


class EngineWorker:
  """Runs `engine.step()` on its own thread while there is work; idles otherwise."""

  def __init__(self, engine):
    self.engine = engine
    self._wake = threading.Event()
    self._stop = False
    self._thread = threading.Thread(target=self._run, name="jaxpar-engine", daemon=True)
    self._thread.start()

  def enqueue(self, requests):
    for request in requests:
      self.engine.enqueue(request)
    self._wake.set()

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
        if self.engine.lockstep is not None:
          self.engine.lockstep.failed(e)  # the other processes may be inside the failed program: the job ends
        self.engine.stats["step_failures"] += 1
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


class Server:
  """What the routes share: the replicas (one engine, or several), their worker threads, the
  metrics, the model's name. `engine` is the first replica: the tokenizer, model and adapters
  every replica shares."""

  def __init__(self, engine, model_name: str, max_queue: int, chat=None, sampling: dict | None = None):
    self.replicas = engine if isinstance(engine, (Replicas, Disaggregated)) else Replicas([engine])
    self.engine, self.model_name, self.max_queue = self.replicas.engines[0], model_name, max_queue
    # For requests that leave them out: OpenAI's defaults, or the run's (`jaxpar serve`).
    self.sampling = {"temperature": 1.0, "top_p": 1.0, **(sampling or {})}
    # Chat prompts: the renderer given (the run's template, or --chat-template), else the tokenizer's own.
    tokenizer = self.engine.tokenizer
    own = getattr(tokenizer, "chat_template", None)
    self.chat = chat if chat is not None or not own else ChatRenderer(
        own, bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "")
    # Where a chat answer ends, as `generate --chat` ends it: the template's end of turn, a stop
    # token where the tokenizer has it as one, else a stop string (byte tokens).
    end = _end_of_turn(self.chat)
    end_ids = tokenizer.encode(end) if end else []
    self.chat_stop_ids = tuple(end_ids) if len(end_ids) == 1 else ()
    self.chat_stop = (end,) if len(end_ids) > 1 else ()
    self.metrics = ServingMetrics(self.replicas.engines)
    self.workers: list[EngineWorker] = []  # one per replica, while serving
    self.draining = False

  @property
  def pending(self) -> int:
    """Requests waiting for a slot, on every replica."""
    return sum(engine.pending for engine in self.replicas.engines)

  @property
  def model_names(self) -> list[str]:
    """The base's name, then each served LoRA adapter's (a request picks one by `model`)."""
    return [self.model_name, *self.engine.adapters]

  def adapter(self, body) -> str | None:
    """The adapter a checked request asks for (None: the base)."""
    return body.model if body.model in self.engine.adapters else None

  def check(self, body):
    if body.model is not None and body.model not in self.model_names:
      raise api.APIError(404, f"the model '{body.model}' does not exist: this server serves "
                         f"{', '.join(repr(n) for n in self.model_names)}", param="model", code="model_not_found")
    if self.draining:
      raise api.APIError(503, "the server is shutting down", kind="server_error")


def _end_of_turn(chat) -> str:
  """The text a chat template writes after an answer ("" without a template, or where the
  template refuses the probe conversation)."""
  try:
    return chat.end_of_turn() if chat is not None else ""
  except DataError:
    return ""


def build_app(engine, *, model_name: str, max_queue: int = 64, grace_s: float = 30.0, chat=None,
              sampling: dict | None = None) -> FastAPI:
  """The ASGI app serving `engine` (an Engine, `replicas.Replicas` or `disaggregated.Disaggregated`) as
  model `model_name`; `chat`: the ChatRenderer of chat
  prompts (default: the tokenizer's template); `sampling`: {"temperature", "top_p"} for requests
  that leave them out (default: OpenAI's, 1 and 1; `jaxpar serve`: the run's sample settings)."""
  server = Server(engine, model_name, max_queue, chat, sampling)
  engine, engines = server.engine, server.replicas.engines

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    server.workers = [EngineWorker(e) for e in engines]
    if isinstance(server.replicas, Disaggregated):  # written prompts wake the decode thread
      server.replicas.deliver = server.workers[1].enqueue
    yield
    server.draining = True
    await asyncio.gather(*(asyncio.to_thread(worker.close, grace_s) for worker in server.workers))

  app = FastAPI(title="jaxpar", lifespan=lifespan)
  app.state.server = server

  @app.exception_handler(api.APIError)
  async def _api_error(_request, error: api.APIError):
    return JSONResponse(error.body(), status_code=error.status)

  @app.exception_handler(StarletteHTTPException)
  async def _http_error(request: Request, error: StarletteHTTPException):
    # Starlette's own replies (no such path, wrong method) in OpenAI's error shape too.
    paths = ", ".join(sorted({route.path for route in app.routes if route.path.startswith(("/v1", "/health", "/metrics"))}))
    message = (f"{request.method} {request.url.path}: {error.detail}" +
               (f"; this server serves {paths}" if error.status_code in (404, 405) else ""))
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    reply = api.APIError(error.status_code, message, kind=kind)
    return JSONResponse(reply.body(), status_code=error.status_code, headers=error.headers)

  @app.get("/health")
  async def health():
    if server.draining or not server.workers:
      return JSONResponse({"status": "unavailable"}, status_code=503)
    each = [{"waiting": e.pending, "slots": len(e.slots), "busy_slots": sum(r is not None for r in e.slots)}
            for e in engines]
    totals = {key: sum(replica[key] for replica in each) for key in each[0]}
    return {"status": "ok", **totals, **({"replicas": each} if len(each) > 1 else {})}

  @app.get("/metrics")
  async def metrics():
    return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

  @app.get("/v1/models")
  async def models():
    # Adapters name their base as `parent`, as vLLM lists its LoRA modules.
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": int(time.time()), "owned_by": "jaxpar",
         "max_model_len": engine.max_seq_len, **({"parent": model_name} if name != model_name else {})}
        for name in server.model_names]}

  @app.post("/v1/completions")
  async def completions(request: Request):
    body, headers = _parse(api.CompletionRequest, await _json(request))
    server.check(body)
    return await _answer(handlers.Call(server, body, handlers.completion_prompts(server, body), chat=False,
                                       headers=headers))

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    body, headers = _parse(api.ChatRequest, await _json(request))
    server.check(body)
    return await _answer(handlers.Call(server, body, [handlers.chat_prompt(server, body)], chat=True,
                                       headers=headers))

  async def _answer(call):
    call.submit()
    return call.stream() if call.body.stream else await call.respond()

  @app.post("/tokenize")
  async def tokenize(request: Request):
    body, headers = _parse(api.TokenizeRequest, await _json(request))
    server.check(body)
    if body.messages is not None:
      ids = handlers.chat_prompt(server, body)
    else:
      ids = engine.encode(body.prompt, body.add_special_tokens is not False)
    answer = {"count": len(ids), "max_model_len": engine.max_seq_len, "tokens": ids}
    if body.return_token_strs:
      answer["token_strs"] = [engine.tokenizer.token_text(t) for t in ids]
    return JSONResponse(answer, headers=headers)

  @app.post("/detokenize")
  async def detokenize(request: Request):
    body, headers = _parse(api.DetokenizeRequest, await _json(request))
    server.check(body)
    vocab = engine.runtime.model_config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
      raise api.APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)}, headers=headers)

  @app.get("/tokenizer_info")
  async def tokenizer_info():
    tokenizer = engine.tokenizer
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token or None,
            "bos_token": tokenizer.bos_token or None, "chat_template": server.chat.source if server.chat else None,
            "model_max_length": engine.max_seq_len}

  return app


def _parse(kind, raw) -> tuple:
  """A validated request and the response headers naming the fields it ignored."""
  body, ignored = api.parse(kind, raw)
  for name in ignored:
    if name not in _warned:
      _warned.add(name)
      log.warning("ignoring the unknown request field %r (named in the %s response header)", name,
                  api.IGNORED_HEADER)
  return body, {api.IGNORED_HEADER: ", ".join(ignored)} if ignored else {}


async def _json(request: Request):
  raw = await request.body()
  try:
    return json.loads(raw)
  except (json.JSONDecodeError, UnicodeDecodeError):
    raise api.APIError(400, "could not parse the JSON body of your request: send valid JSON") from None


def serve(engine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 64,
          grace_s: float = 30.0, log_level: str = "info", announce=None, chat=None, sampling: dict | None = None):
  """Serve until SIGTERM / Ctrl-C (uvicorn stops taking requests and drains). The socket is
  bound first, so port 0 takes a free port with no race; announce(url) is called with the
  address bound, before the first request."""
  app = build_app(engine, model_name=model_name, max_queue=max_queue, grace_s=grace_s, chat=chat,
                  sampling=sampling)
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.bind((host, port))
  if announce is not None:
    announce(f"http://{host}:{sock.getsockname()[1]}/v1")
  server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace_s + 5))
  # After draining, uvicorn re-raises the signal to the handler that was there before it;
  # ours only records it, so a drained server exits 0 instead of dying by the signal.
  with stop_on_signals():
    server.run(sockets=[sock])
