"""`jaxpar serve` as clients meet it: the official `openai` client for completions and chat,
streamed or not, many clients at once, malformed requests, a full queue, a client that
leaves mid-stream, an engine failure mid-stream, and SIGTERM; correct answers after all."""

import concurrent.futures
import http.client
import json
import signal
import socket
import threading
import time

import jax
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import MeshConfig, from_dict
from jaxpar.data import copy_tokenizer_files
from jaxpar.inference import Engine
from jaxpar.inference.server import build_app
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL
from tests.serving_setup import CliServer
from tests.test_data import _train_hf_tokenizer

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
MODEL_NAME = "tiny-test"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A random-weight model saved with a BPE tokenizer that has a chat template, laid out as
  a run: runs/MODEL_NAME/checkpoints."""
  root = tmp_path_factory.mktemp("serve")
  (root / "tok").mkdir()
  _train_hf_tokenizer(root / "tok" / "tokenizer.json")
  (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
  config = from_dict({"model": {**SMALL_MODEL, "max_seq_len": 96}, "mesh": {"fsdp": 1}, "data": {"seq_len": 32}})
  runtime = Runtime(config.model, MeshConfig(fsdp=1), jax.devices()[:1])
  params, _ = runtime.init()
  directory = root / MODEL_NAME / "checkpoints"
  with Checkpointer(directory) as checkpoints:
    checkpoints.save(0, {"params": params}, config=config, force=True)
  copy_tokenizer_files(root / "tok", directory / "tokenizer")
  return directory


def _engine(checkpoint):
  return Engine.from_checkpoint(checkpoint, devices=jax.devices()[:1], slots=2, page_size=8,
                                prefill_chunks=(8, 32))


@pytest.fixture(scope="module")
def reference(checkpoint):
  """A second engine on the same weights: the answers the server must give (the served one
  belongs to the server's thread)."""
  return _engine(checkpoint)


@pytest.fixture(scope="module")
def server(checkpoint):
  """An in-process server (uvicorn on a thread) on 127.0.0.1: max 4 waiting requests."""
  engine = _engine(checkpoint)
  app = build_app(engine, model_name=MODEL_NAME, max_queue=4, grace_s=5)
  instance = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
  thread = threading.Thread(target=instance.run, daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not instance.started:
    assert time.monotonic() < deadline, "the server did not start"
    time.sleep(0.05)
  port = instance.servers[0].sockets[0].getsockname()[1]  # port 0: the one it bound
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
  yield engine, port, client
  instance.should_exit = True
  thread.join(timeout=30)


def _expected(reference, prompt, max_tokens):
  """What an engine alone makes of a prompt, greedily."""
  from jaxpar.inference import SamplingParams
  return reference.generate([prompt], SamplingParams(max_tokens=max_tokens))[0]


def _raw(port, method, path, body=None, headers=None):
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  connection.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
  response = connection.getresponse()
  data = response.read()
  connection.close()
  return response.status, json.loads(data) if data else None


def test_completions_and_chat_streamed_or_not(server, reference):
  engine, port, client = server
  assert [m.id for m in client.models.list().data] == [MODEL_NAME]
  # Greedy answers equal the engine's own, streamed or not; usage counts are right.
  full = client.completions.create(model=MODEL_NAME, prompt="the quick", max_tokens=8, temperature=0)
  expected = _expected(reference, "the quick", 8)
  assert full.choices[0].text == expected.text and full.choices[0].finish_reason == expected.finish_reason
  assert full.usage.prompt_tokens == len(engine.encode("the quick"))
  assert full.usage.completion_tokens == len(expected.tokens)
  chunks = list(client.completions.create(model=MODEL_NAME, prompt="the quick", max_tokens=8, temperature=0,
                                          stream=True, stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
  assert chunks[-1].usage.completion_tokens == len(expected.tokens) and not chunks[-1].choices
  # Chat goes through the model's template.
  messages = [{"role": "user", "content": "a fox"}]
  reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True)
  templated = _expected(reference, engine.tokenizer.encode("<|user|>a fox\n<|assistant|>"), 6)
  assert reply.choices[0].message.content == templated.text and reply.choices[0].message.role == "assistant"
  assert len(reply.choices[0].logprobs.content) == len(templated.tokens)
  streamed = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                            stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == templated.text


def test_many_concurrent_clients_get_their_own_answers(server, reference):
  _, _, client = server
  prompts = [f"the dog {i}" for i in range(10)]
  expected = {p: _expected(reference, p, 5).text for p in prompts}

  def ask(prompt):
    for attempt in range(20):  # bounded: a 429 (queue of 4) means try again shortly
      try:
        return prompt, client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5,
                                                 temperature=0).choices[0].text
      except openai.RateLimitError:
        time.sleep(0.2)
    raise AssertionError("never admitted")
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    answers = dict(pool.map(ask, prompts))
  assert answers == expected


def test_malformed_requests_get_openai_errors(server):
  engine, port, client = server
  status, body = _raw(port, "POST", "/v1/completions", body=b"{not json")
  assert status == 400 and "could not parse the JSON body" in body["error"]["message"]
  cases = [
    ({"model": MODEL_NAME}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "x" * 200}, 400, "prompt"),  # longer than the context of 96
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 500}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ({"model": MODEL_NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "model"),
  ]
  for request, status, param in cases:
    got, body = _raw(port, "POST", "/v1/completions", body=json.dumps(request))
    assert (got, body["error"]["param"]) == (status, param), (request, body)
    assert body["error"]["message"] and body["error"]["type"]
  with pytest.raises(openai.BadRequestError, match="maximum context length is 96"):
    client.completions.create(model=MODEL_NAME, prompt="x" * 200)
  assert _raw(port, "GET", "/health")[1]["status"] == "ok"
  for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
    got, body = _raw(port, method, path)  # the framework's own errors, in the same shape
    assert got == status and body["error"]["message"].startswith(f"{method} {path}: "), body
    assert "/v1/chat/completions" in body["error"]["message"] and body["error"]["type"], body


def test_full_queue_is_429_and_disconnect_frees_the_slot(server, monkeypatch):
  """The engine is held still while 10 requests arrive: the queue (4) takes the first four,
  the other six get 429 whatever the timing; let go, the four finish."""
  engine, port, client = server
  outcomes, gate, real_step = [], threading.Event(), engine.step
  monkeypatch.setattr(engine, "step", lambda: gate.wait(120) and real_step())

  def long_request():
    try:
      client.completions.create(model=MODEL_NAME, prompt="the", max_tokens=60, temperature=0)
      outcomes.append("ok")
    except openai.RateLimitError:
      outcomes.append(429)
  threads = [threading.Thread(target=long_request) for _ in range(10)]
  for thread in threads:
    thread.start()
  deadline = time.monotonic() + 60
  while (outcomes.count(429) < 6 or engine.pending < 4) and time.monotonic() < deadline:
    time.sleep(0.05)
  gate.set()
  for thread in threads:
    thread.join(timeout=120)
  monkeypatch.setattr(engine, "step", real_step)
  assert sorted(outcomes, key=str) == [429] * 6 + ["ok"] * 4, outcomes
  # A client reads one streamed chunk and hangs up: its slot and pages come back.
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
  connection.request("POST", "/v1/completions", body=json.dumps(
      {"model": MODEL_NAME, "prompt": "the", "max_tokens": 80, "stream": True, "temperature": 0}),
      headers={"Content-Type": "application/json"})
  response = connection.getresponse()
  assert response.readline().startswith(b"data: ")
  connection.sock.shutdown(socket.SHUT_RDWR)
  connection.close()
  deadline = time.monotonic() + 30
  while _raw(port, "GET", "/health")[1]["busy_slots"] and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(engine.slots) and engine.pool.free == engine.pool.num_pages


def test_engine_failure_mid_stream_reaches_the_client_then_the_server_recovers(server, reference, monkeypatch):
  engine, _, client = server
  real_step, calls = engine.step, []

  def failing_step():
    calls.append(1)
    if len(calls) == 3:
      raise RuntimeError("injected failure")
    return real_step()
  monkeypatch.setattr(engine, "step", failing_step)
  with pytest.raises(openai.APIError, match="injected failure"):
    for _ in client.completions.create(model=MODEL_NAME, prompt="the", max_tokens=30, temperature=0, stream=True):
      pass
  monkeypatch.setattr(engine, "step", real_step)
  again = client.completions.create(model=MODEL_NAME, prompt="the quick", max_tokens=8, temperature=0)
  assert again.choices[0].text == _expected(reference, "the quick", 8).text


@pytest.mark.slow
def test_cli_serve_drains_on_sigterm_and_exits_0(checkpoint):
  served = CliServer(checkpoint, "--slots", "2")  # `serve RUN`, as `vllm serve MODEL`; the model id: the run's name
  try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    # A request that leaves temperature and top_p out samples as the run's closing sample (0.8, 0.95).
    texts = [client.completions.create(model=MODEL_NAME, prompt="the", max_tokens=8, seed=3, **extra).choices[0].text
             for extra in ({}, {"temperature": 0.8, "top_p": 0.95})]
    assert texts[0] == texts[1], texts
    stream = client.completions.create(model=MODEL_NAME, prompt="the", max_tokens=40, temperature=0, stream=True)
    first = next(iter(stream))
    served.child.send_signal(signal.SIGTERM)
    rest = list(stream)  # the request in flight still finishes
    assert first.choices and rest and rest[-1].choices[0].finish_reason in ("stop", "length")
    assert served.child.wait(timeout=60) == 0
  finally:
    served.stop()
  assert f"serving 'tiny-test' on http://127.0.0.1:{served.port}/v1" in served.rest_of_output()


def test_a_run_is_named_by_its_run_directory(checkpoint, tmp_path):
  from jaxpar.weights import run_name
  assert run_name(checkpoint.parent) == run_name(checkpoint) == run_name(checkpoint / "0") == MODEL_NAME
  (tmp_path / "llama-import").mkdir()  # a converted model's checkpoint dir, no run around it
  assert run_name(tmp_path / "llama-import") == "llama-import"


def test_metrics_parse_as_prometheus_text_and_move_with_the_traffic(server):
  from prometheus_client.parser import text_string_to_metric_families
  engine, port, client = server

  def scrape():
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain")
    text = response.read().decode()
    connection.close()
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
  before = scrape()
  done = client.completions.create(model=MODEL_NAME, prompt="the quick", max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
  after = scrape()
  one = '{"replica": "0"}'  # the engine's state, labelled by replica (one here)
  moved = lambda name, labels=one: after[name + labels] - before.get(name + labels, 0)  # noqa: E731
  assert moved("jaxpar_generation_tokens_total", "{}") == done.usage.completion_tokens == 6
  assert moved("jaxpar_prompt_tokens_total", "{}") == done.usage.prompt_tokens
  assert moved("jaxpar_requests_finished_total", '{"finish_reason": "length"}') == 1
  assert moved("jaxpar_time_to_first_token_seconds_count", "{}") == 1
  assert moved("jaxpar_inter_token_latency_seconds_count", "{}") == 5
  assert moved("jaxpar_prefill_tokens_total") == done.usage.prompt_tokens - 1  # the last one is decoded
  assert after["jaxpar_kv_pages_used" + one] + after["jaxpar_kv_pages_free" + one] == engine.pool.num_pages
  assert after["jaxpar_requests_running" + one] == 0 and after["jaxpar_requests_waiting" + one] == 0
  assert after["jaxpar_generation_tokens_per_second{}"] > 0
  for name in ("jaxpar_preemptions_total", "jaxpar_prefix_cache_hit_rate", "jaxpar_slots",
               "jaxpar_engine_failures_total"):
    assert name + one in after
  # The same prompt twice: the second takes the first's complete pages from the prefix cache.
  prompt = "the lazy dog sleeps while the quick brown fox jumps over the dog and runs"
  first, second = (client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1) for _ in range(2))
  shared = (first.usage.prompt_tokens - 1) // engine.pool.page_size * engine.pool.page_size
  assert shared >= 8 and first.usage.prompt_tokens_details.cached_tokens == 0
  assert second.usage.prompt_tokens_details.cached_tokens == shared
  before, after = after, scrape()
  assert moved("jaxpar_prefix_cache_hits_total") == shared
  assert moved("jaxpar_prefix_cache_queries_total") == 2 * (first.usage.prompt_tokens - 1)
  assert moved("jaxpar_prefill_tokens_total") == 2 * (first.usage.prompt_tokens - 1) - shared


@pytest.mark.slow
@pytest.mark.parametrize("source", ["draft", "ngram"])
def test_cli_serve_speculative_gives_the_plain_greedy_tokens(checkpoint, reference, source):
  """`jaxpar serve --speculative draft=PATH,k=3` (the model as its own draft) or `ngram,k=3`
  (prompt lookup): the openai client gets exactly the plain engine's greedy text, streamed or not."""
  spec = f"draft={checkpoint},k=3" if source == "draft" else "ngram,k=3"
  served = CliServer("--checkpoint", checkpoint, "--slots", "2", "--speculative", spec)
  try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    for prompt in ("the quick", "a fox"):
      want = _expected(reference, prompt, 20).text
      got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0)
      assert got.choices[0].text == want
      stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0, stream=True)
      assert "".join(c.choices[0].text for c in stream if c.choices) == want
    refused = _raw(served.port, "POST", "/v1/completions",
                   json.dumps({"model": MODEL_NAME, "prompt": "the", "max_tokens": 2, "logprobs": 1}))
    assert refused[0] == 400 and "speculative" in refused[1]["error"]["message"]
    # A request turns speculation off: the same text, no proposals, one token per target pass;
    # usage reports what the draft did (jaxpar's extension), /metrics the totals.
    on, off = (client.completions.create(model=MODEL_NAME, prompt="the quick the quick", max_tokens=20,
                                         temperature=0, extra_body={"speculative": flag}) for flag in (True, False))
    assert on.choices[0].text == off.choices[0].text == _expected(reference, "the quick the quick", 20).text
    spec_on, spec_off = on.usage.model_extra["speculative"], off.usage.model_extra["speculative"]
    assert spec_off["proposed_tokens"] == 0 and spec_off["target_passes"] == off.usage.completion_tokens
    assert spec_on["target_passes"] + spec_on["accepted_tokens"] == on.usage.completion_tokens
    assert spec_on["mean_accepted_length"] == spec_on["accepted_tokens"] / spec_on["target_passes"]
    if source == "draft":  # the model as its own draft: every proposal kept
      assert spec_on["accepted_tokens"] == spec_on["proposed_tokens"] > 0
    from prometheus_client.parser import text_string_to_metric_families
    connection = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    connection.request("GET", "/metrics")
    families = {f.name: f for f in text_string_to_metric_families(connection.getresponse().read().decode())}
    assert families["jaxpar_speculative_draft_tokens"].samples[0].value >= spec_on["proposed_tokens"]
    assert families["jaxpar_speculative_tokens_per_pass"].samples[0].value >= 1
  finally:
    served.stop()
