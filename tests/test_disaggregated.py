"""Disaggregated prefill and decode (`jaxpar serve --prefill-devices N`): prompts written on 4
devices, their KV pages moved onto 4 others and decoded there give the co-located engine's
tokens, float and int8 caches alike, through the Python API and the `openai` client; the
moves are counted; engines that cannot hand over are refused in one line."""

import jax
import pytest

from jaxpar.errors import ConfigError
from jaxpar.inference import Engine, SamplingParams
from jaxpar.inference.disaggregated import Disaggregated
from tests.helpers import SMALL_MODEL, counting_compiles
from tests.serving_setup import RunningServer, random_checkpoint

PROMPTS = ["the quick brown fox jumps over the lazy dog and the dog sleeps", "a fox", "the dog sleeps while a fox runs",
           "a"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return random_checkpoint(tmp_path_factory.mktemp("disaggregated"), {**SMALL_MODEL, "max_seq_len": 96})


def _engine(checkpoint, devices, kv_cache="float", slots=2):
  return Engine.from_checkpoint(checkpoint, devices=devices, slots=slots, page_size=8, prefill_chunks=(8, 32),
                                kv_cache=kv_cache)


@pytest.mark.parametrize("kv_cache", ["float", "int8"])
def test_prompts_moved_to_the_decode_devices_give_the_colocated_tokens(checkpoint, kv_cache):
  devices = jax.devices()
  colocated = _engine(checkpoint, devices[4:], kv_cache)
  expected = colocated.generate(PROMPTS, SamplingParams(max_tokens=12, logprobs=True))
  split = Disaggregated(_engine(checkpoint, devices[:4], kv_cache), _engine(checkpoint, devices[4:], kv_cache))
  done = split.generate(PROMPTS, SamplingParams(max_tokens=12, logprobs=True))
  assert [d.tokens for d in done] == [e.tokens for e in expected]
  for d, e in zip(done, expected):
    assert d.logprobs == pytest.approx(e.logprobs, abs=1e-5)
  stats = split.decode.stats
  assert stats["kv_transfers"] == len(PROMPTS) and stats["kv_transfer_bytes"] > 0
  # The decode engine computed no prompt: every prompt token came over from the prefill devices.
  assert stats["prefill_tokens"] == 0 and split.prefill.stats["prefill_tokens"] > 0
  assert split.prefill.pool.free == split.prefill.pool.num_pages and split.decode.pool.free == split.decode.pool.num_pages


def test_the_openai_client_gets_the_colocated_tokens_while_prompts_move(checkpoint):
  import concurrent.futures
  devices = jax.devices()
  colocated = _engine(checkpoint, devices[4:], slots=4)
  expected = colocated.generate(PROMPTS, SamplingParams(max_tokens=10))
  split = Disaggregated(_engine(checkpoint, devices[:4]), _engine(checkpoint, devices[4:], slots=4))
  server = RunningServer(split, "tiny")
  try:
    def ask(prompt: str, stream: bool):
      answer = server.client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                                stream=stream)
      return "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      texts = list(pool.map(ask, PROMPTS * 2, [False] * 4 + [True] * 4))
    assert texts == [e.text for e in expected] * 2
    from prometheus_client.parser import text_string_to_metric_families
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics")[1].decode())}
    moved = {s.labels["replica"]: s.value for s in families["jaxpar_kv_transfers"].samples if s.name.endswith("total")}
    assert moved == {"0": 0, "1": 8}
  finally:
    server.close()


def test_engines_that_cannot_hand_over_are_refused(checkpoint, capsys):
  from jaxpar.cli import main
  from jaxpar.inference.disaggregated import split_devices
  devices = jax.devices()
  with pytest.raises(ConfigError, match="share devices"):
    Disaggregated(_engine(checkpoint, devices[:2]), _engine(checkpoint, devices[1:3]))
  with pytest.raises(ConfigError, match="same model, adapters, page size, KV cache kind"):
    Disaggregated(_engine(checkpoint, devices[:2]), _engine(checkpoint, devices[2:4], kv_cache="int8"))
  with pytest.raises(ConfigError, match="give 1 to 7 of the 8 devices"):
    split_devices(8)
  assert main(["serve", str(checkpoint), "--prefill-devices", "4", "--replicas", "2"]) == 2
  assert "--prefill-devices with --replicas: choose one" in capsys.readouterr().err
  with counting_compiles() as compiled:
    assert main(["serve", str(checkpoint), "--prefill-devices", "4", "--speculative", "ngram"]) == 2
  assert "speculative decoding with disaggregated prefill is not supported" in capsys.readouterr().err
  assert compiled == []
