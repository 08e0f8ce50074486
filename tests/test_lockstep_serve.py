"""`jaxpar launch-local 2 -- serve`: one engine over 2 processes x 4 simulated devices, process 0
serving HTTP and process 1 running its device calls in lock step. The `openai` client's greedy
completions, with log-probs and streamed, equal one process on one device: a dense model
tensor-parallel over all 8 devices or over 4 with rows split over the processes (decoding
speculatively), and a mixture of experts expert-parallel over all 8 with an int8 KV cache.
kill -9 of process 1 mid-stream ends the client's stream with an error and the job non-zero
within the peer timeout; SIGTERM to the launcher drains and exits 0."""

import json
import os
import re
import signal
import threading
import time
import urllib.request

import jax
import openai
import pytest

from jaxpar.inference import Engine, SamplingParams
from jaxpar.inference.lockstep import FLOW_WINDOW, Lockstep
from tests.helpers import SMALL_MODEL, Job
from tests.serving_setup import random_checkpoint

PEER_TIMEOUT = 5
PROMPTS = ["the dog", "a fox runs over", "the quick brown fox", "a"]
MODELS = {
    "dense": {**SMALL_MODEL, "num_heads": 8, "head_dim": 8, "max_seq_len": 96},
    "moe": {**SMALL_MODEL, "family": "mixtral", "max_seq_len": 96,
            "moe": {"num_experts": 8, "experts_per_token": 2, "expert_mlp_dim": 32}},
}


class LockstepServer:
  """`jaxpar launch-local 2 -- serve CHECKPOINT ARGS --port 0`, and the official client on it."""

  def __init__(self, checkpoint, *args):
    self.job = Job("launch-local", "2", "--grace", "10", "--", "serve", str(checkpoint), *args, "--slots", "2",
                   "--page-size", "8", "--port", "0", "--peer-timeout", str(PEER_TIMEOUT))
    self.pids = self.job.pids()
    port = int(self.job.wait_for(r" on http://127\.0\.0\.1:(\d+)/v1").group(1))
    deadline = time.monotonic() + 120
    while True:  # bound, then listening once uvicorn has started
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
          break
      except OSError:
        assert time.monotonic() < deadline, self.job.text[-3000:]
        time.sleep(0.2)
    self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                timeout=120)


def _same_as_one_process(server, checkpoint, kv_cache="float", logprobs=True):
  reference = Engine.from_checkpoint(checkpoint, devices=jax.devices()[:1], slots=2, page_size=8, kv_cache=kv_cache)
  expected = reference.generate(PROMPTS, SamplingParams(max_tokens=12, logprobs=True))
  for prompt, want in zip(PROMPTS, expected):
    got = server.client.completions.create(model="ckpt", prompt=prompt, max_tokens=12, temperature=0,
                                           logprobs=0 if logprobs else None)
    assert got.choices[0].text == want.text, prompt
    if logprobs:
      assert got.choices[0].logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    stream = server.client.completions.create(model="ckpt", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want.text


@pytest.mark.long  # a multi-process server: ~40 s
def test_tensor_parallel_over_two_processes_then_kill_9_ends_the_job(tmp_path):
  checkpoint = random_checkpoint(tmp_path, MODELS["dense"])
  server = LockstepServer(checkpoint, "mesh.tensor=8")
  try:
    _same_as_one_process(server, checkpoint)
    stream = iter(server.client.completions.create(model="ckpt", prompt="the dog", max_tokens=80, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    os.kill(server.pids[1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError):  # the connection ends mid-stream
      for _ in stream:
        pass
    assert server.job.finish(timeout=PEER_TIMEOUT + 60) != 0
    assert time.monotonic() - killed < PEER_TIMEOUT + 30, server.job.text[-2000:]
    # Named in one line: the collective process 1 left (gloo's reset connection), or its silence.
    assert re.search(r"\[process 0\] error: (the engine failed while serving in lock step|process 1 stopped "
                     r"responding)", server.job.text), server.job.text[-2000:]
  finally:
    server.job.kill_all()


@pytest.mark.long  # a multi-process server: ~40 s
def test_speculative_rounds_with_rows_across_the_processes(tmp_path):
  """tensor=4 x data=2, prompt-lookup speculation: its rounds (proposals, the target's check,
  the accepted counts read back) run in lock step too."""
  checkpoint = random_checkpoint(tmp_path, MODELS["dense"])
  server = LockstepServer(checkpoint, "mesh.tensor=4", "mesh.data=2", "--speculative", "ngram,k=3")
  try:
    _same_as_one_process(server, checkpoint, logprobs=False)
    # Then process 1 hangs (SIGSTOP): the next request waits in a collective until the
    # heartbeat misses it; process 0 names it and the job ends non-zero, nothing hangs.
    os.kill(server.pids[1], signal.SIGSTOP)
    hung = time.monotonic()
    with pytest.raises(openai.APIError):  # process 0 stopped: the connection ends
      server.client.completions.create(model="ckpt", prompt="the dog", max_tokens=8, temperature=0)
    assert time.monotonic() - hung < PEER_TIMEOUT + 30
    server.job.wait_for(r"\[process 0\] error: process 1 stopped responding", timeout=30)
    assert server.job.finish(timeout=90) != 0  # the launcher kills the stopped process after its --grace
  finally:
    server.job.kill_all()


@pytest.mark.long  # a multi-process server: ~40 s
def test_expert_parallel_over_two_processes_with_an_int8_cache_then_sigterm_drains(tmp_path):
  checkpoint = random_checkpoint(tmp_path, MODELS["moe"])
  server = LockstepServer(checkpoint, "mesh.expert=8", "--kv-cache", "int8")
  try:
    _same_as_one_process(server, checkpoint, kv_cache="int8")
    stream = iter(server.client.completions.create(model="ckpt", prompt="the dog", max_tokens=40, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
    first = next(stream)
    server.job.process.send_signal(signal.SIGTERM)
    rest = list(stream)  # the request in flight still finishes
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    assert server.job.finish(timeout=120) == 0, server.job.text[-2000:]
  finally:
    server.job.kill_all()


class _Store:
  """The coordination service's key-value calls that lock step makes, in this process (the
  protocol's logic: the real service carries it in the launched tests above)."""

  def __init__(self):
    self.values, self.changed, self.most = {}, threading.Condition(), 0

  def key_value_set(self, key, value):
    self.key_value_set_bytes(key, value.encode())

  def key_value_set_bytes(self, key, value):
    with self.changed:
      self.values[key] = value
      self.most = max(self.most, sum(k[-1].isdigit() and "/ran/" not in k for k in self.values))
      self.changed.notify_all()

  def blocking_key_value_get_bytes(self, key, timeout_ms):
    with self.changed:
      if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
      return self.values[key]

  blocking_key_value_get = blocking_key_value_get_bytes

  def key_value_delete(self, key):
    with self.changed:
      del self.values[key]


class _Replayed:
  draft = None

  def __init__(self):
    self.calls, self.fed_back = [], []

  def replay(self, kind, rows):
    self.calls.append((kind, rows[0].tolist(), rows[1]["seed"].tolist()))
    self.fed_back.append(rows[0] is getattr(self, "output", None))  # its own output, not a copy
    self.output = jax.numpy.asarray(rows[0]) + 1
    return (self.output, {"cache": None})


def test_followers_replay_every_call_in_order_with_their_own_fed_back_outputs_and_a_bounded_store():
  store, sent = _Store(), []
  leader = Lockstep(_Replayed(), (store, 0, 3, 30.0))
  followers = [Lockstep(_Replayed(), (store, i, 3, 30.0)) for i in (1, 2)]
  threads = [threading.Thread(target=f.follow) for f in followers]
  for thread in threads:
    thread.start()
  engine, output = leader.engines[0], None
  for n in range(3 * FLOW_WINDOW + 5):
    # Device arrays go as numpy; every fifth call feeds back the last call's output (run-ahead).
    tokens = output if n % 5 == 4 else jax.numpy.full((2, 1), n)
    rows = (tokens, {"seed": jax.numpy.arange(2) + n})
    leader.publish(engine, "step" if n % 3 else "fill", rows)
    output = jax.numpy.asarray(tokens) + 1
    leader.returned(engine, (output, {"cache": None}))
    sent.append(("step" if n % 3 else "fill", tokens.tolist(), [n, n + 1]))
  leader.finish()
  for thread in threads:
    thread.join(timeout=60)
  assert all(f.engines[0].calls == sent for f in followers)
  assert all(f.engines[0].fed_back == [n % 5 == 4 for n in range(len(sent))] for f in followers)
  assert store.most <= 2 * FLOW_WINDOW + 1, store.most  # old messages deleted as every process passes them


@pytest.mark.long  # a multi-process run: ~30 s
def test_generate_over_two_processes_with_rows_split_across_them(tmp_path):
  """`launch-local 2 -- generate`: every process runs the same prompts (rows over data=8, so
  each process holds half of them); process 0 writes what one process on one device writes.
  Through a file: on standard output, gloo's C++ banners share the processes' stream with
  the streamed tokens and can split their line (seen in CI)."""
  checkpoint = random_checkpoint(tmp_path, MODELS["dense"])
  reference = Engine.from_checkpoint(checkpoint, devices=jax.devices()[:1], slots=8, page_size=8)
  prompts = ["the dog", "a cat sat"]
  want = [c.text for c in reference.generate(prompts, SamplingParams(max_tokens=10))]
  (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
  output = tmp_path / "out.jsonl"
  job = Job("launch-local", "2", "--grace", "10", "--", "generate", str(checkpoint), "mesh.data=8", "mesh.fsdp=1",
            "--prompts-file", str(tmp_path / "prompts.jsonl"), "--output", str(output),
            "--max-tokens", "10", "--temperature", "0", "--page-size", "8")
  try:
    assert job.finish() == 0, job.text[-2000:]
    assert [json.loads(line)["text"] for line in output.read_text().splitlines()] == want
  finally:
    job.kill_all()
