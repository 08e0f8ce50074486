"""Data-parallel replicas behind one server (`jaxpar serve --replicas N`): two engines of four
devices each give the one engine's greedy tokens and log-probs to the `openai` client,
requests that share a prefix meet on the replica caching it (as many prefix-cache hits as one
engine gets on the same traffic), a hot prefix spills over to the other replica, /metrics and
/health show each replica, and replica counts that do not divide the devices are refused."""

import concurrent.futures
import json

import jax
import pytest

from jaxpar.cli import main
from jaxpar.errors import ConfigError
from jaxpar.inference import Engine, SamplingParams
from jaxpar.inference.replicas import Replicas, device_groups
from tests.helpers import SMALL_MODEL, counting_compiles
from tests.serving_setup import RunningServer, random_checkpoint

openai = pytest.importorskip("openai")

SHARED = "the quick brown fox jumps over the lazy dog and the dog sleeps while "  # a common system prompt


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return random_checkpoint(tmp_path_factory.mktemp("replicas"), {**SMALL_MODEL, "max_seq_len": 96})


def _engine(checkpoint, devices):
  return Engine.from_checkpoint(checkpoint, devices=devices, slots=2, page_size=8, prefill_chunks=(8, 32))


@pytest.fixture(scope="module")
def served(checkpoint):
  """Two replicas of four devices each behind one server, and one more engine on four devices:
  the answers they must give."""
  replicas = Replicas([_engine(checkpoint, group) for group in device_groups(2)])
  server = RunningServer(replicas, "tiny", max_queue=16)
  yield replicas, server, _engine(checkpoint, jax.devices()[:4])
  server.close()


def test_two_replicas_give_one_engines_greedy_tokens_and_logprobs(served):
  replicas, server, reference = served
  prompts = [f"{SHARED}{tail}" for tail in ("a fox", "the dog", "a fox runs", "the lazy")] + ["a", "the dog sleeps"]
  expected = reference.generate(prompts, SamplingParams(max_tokens=10, logprobs=True))

  def ask(prompt: str, stream: bool):
    answer = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=0,
                                              stream=stream, extra_body={"ignore_eos": False})
    if not stream:
      return answer.choices[0].text, answer.choices[0].logprobs.token_logprobs
    chunks = [c.choices[0] for c in answer if c.choices]
    return "".join(c.text for c in chunks), [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    answers = list(pool.map(ask, prompts * 2, [False] * len(prompts) + [True] * len(prompts)))
  for (text, logprobs), want in zip(answers, expected * 2):
    assert text == want.text
    assert logprobs == pytest.approx(want.logprobs, abs=1e-5)
  assert min(replicas.routed) > 0, replicas.routed  # both replicas served some


def test_a_shared_prefix_meets_its_cache_as_often_as_on_one_engine(served, checkpoint):
  replicas, server, _ = served
  lone = _engine(checkpoint, jax.devices()[:4])
  # Prefixes no other test sent: the replicas hold none of their pages yet.
  traffic = [f"{prefix}{tail}" for tail in (" a", " the dog", " a fox runs", " it") for prefix in
             ("a lazy fox sleeps and the quick brown dog runs over the fox", "dog dog fox the quick lazy brown a a a")]
  cached = [server.client.completions.create(model="tiny", prompt=p, max_tokens=2).usage.prompt_tokens_details
            .cached_tokens for p in traffic]
  alone = []
  for prompt in traffic:
    request = lone.submit(prompt, SamplingParams(max_tokens=2))
    while request.finish_reason is None:
      lone.step()
    alone.append(request.prefix_hits)
  # Were a prefix's requests split between the replicas, the second of them would miss.
  assert cached == alone and sum(cached) >= 8 * len(traffic[2:]), (cached, alone)


def test_a_hot_prefix_spills_over_to_the_less_loaded_replica(served):
  replicas, _, _ = served
  ids = replicas.engines[0].encode("brown brown fox over the lazy lazy dog " * 2)  # cached nowhere
  first, second = replicas.choices(ids, 0)
  assert first != second and not any(replicas.cached_tokens(i, ids, 0) for i in range(2))
  hot = replicas.engines[first]
  # Long enough that a worker that wakes meanwhile still has them running when routing reads the loads.
  held = [hot.make_request(ids, SamplingParams(max_tokens=60)) for _ in range(replicas.slack + 1)]
  loads = lambda: [e.pending + sum(r is not None for r in e.slots) for e in replicas.engines]  # noqa: E731
  try:
    for request in held[:-1]:  # queued straight into the engine, past its worker
      hot.enqueue(request)
    assert replicas.pick(ids) == first, loads()  # busier by `slack`: still where its prefix goes
    hot.enqueue(held[-1])
    assert replicas.pick(ids) == second, loads()  # past the bound: the other choice
  finally:
    for request in held:
      hot.cancel(request)


def test_metrics_and_health_show_each_replica(served):
  from prometheus_client.parser import text_string_to_metric_families
  replicas, server, _ = served
  status, body = server.get("/metrics")
  families = {f.name: f for f in text_string_to_metric_families(body.decode())}
  for name in ("jaxpar_requests_waiting", "jaxpar_prefix_cache_hit_rate", "jaxpar_kv_pages_free"):
    assert sorted(s.labels["replica"] for s in families[name].samples) == ["0", "1"], name
  hits = {s.labels["replica"]: s.value for s in families["jaxpar_prefix_cache_hits"].samples
          if s.name.endswith("_total")}
  assert hits == {str(i): e.stats["prefix_cache_hits"] for i, e in enumerate(replicas.engines)}
  health = json.loads(server.get("/health")[1])
  assert health["slots"] == 4 and [r["slots"] for r in health["replicas"]] == [2, 2]


def test_replicas_that_do_not_divide_the_devices_are_refused_before_compiling(checkpoint, capsys):
  with pytest.raises(ConfigError, match=r"--replicas 3 does not divide the 8 devices .* choose one of \[1, 2, 4, 8\]"):
    device_groups(3)
  with counting_compiles() as compiled:
    assert main(["serve", str(checkpoint), "--replicas", "3"]) == 2
  err = capsys.readouterr().err
  assert "--replicas 3 does not divide the 8 devices" in err and len(err.strip().splitlines()) == 1, err
  assert compiled == []


def test_cli_serve_with_two_replicas(checkpoint, served):
  """`jaxpar serve RUN --replicas 2` on two devices: one engine each, one answer as one engine's."""
  from tests.serving_setup import CliServer
  _, _, reference = served
  cli = CliServer(checkpoint, "--replicas", "2", "--slots", "2", "--page-size", "8",
                  env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  try:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cli.port}/v1", api_key="unused", max_retries=0, timeout=60)
    answers = [client.completions.create(model="ckpt", prompt=p, max_tokens=6, temperature=0).choices[0].text
               for p in ("the dog", "a fox runs")]
    assert answers == [c.text for c in reference.generate(["the dog", "a fox runs"], SamplingParams(max_tokens=6))]
  finally:
    cli.stop()
  output = cli.rest_of_output()
  assert "replica 2 of 2: devices 1" in output and "(2 replicas x 2 slots" in output, output


def test_a_request_whose_replica_fails_before_its_first_token_is_served_by_the_other(served, monkeypatch):
  replicas, server, reference = served
  prompt = next(p for p in (f"retry {i} the dog" for i in range(64))
                if replicas.choices(replicas.engines[0].encode(p), 0)[0] == 0
                and not replicas.cached_tokens(1, replicas.engines[0].encode(p), 0))
  failing = replicas.engines[0]

  def fail():
    raise RuntimeError("injected failure")
  monkeypatch.setattr(failing, "step", fail)
  answer = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
  monkeypatch.undo()
  assert answer.choices[0].text == reference.generate([prompt], SamplingParams(max_tokens=6))[0].text
  assert failing.stats["step_failures"] >= 1
