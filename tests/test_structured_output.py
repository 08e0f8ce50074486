"""Structured output: constrained generations from a random tiny model parse and validate
against their schema; unconstrained requests batched with them come out as they would
alone; mixing the two compiles nothing new; and a batch without constraints never runs the
processing step."""

import json
import re

import jax
import pytest

from jaxpar.config import MeshConfig, ModelConfig
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams, grammar
from jaxpar.runtime import Runtime
from tests.helpers import SMALL_MODEL, counting_compiles

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 2,
                                               "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}}},
     "required": ["tags"], "additionalProperties": False},
    {"enum": [1, 2, "three", None]},
]
REGEX, CHOICES = r"[0-9]{3}-[a-f]{2,4}", ["yes", "no", "maybe not"]


@pytest.fixture(scope="module")
def engine():
  runtime = Runtime(ModelConfig(**{**SMALL_MODEL, "max_seq_len": 192}), MeshConfig(fsdp=1), jax.devices()[:1])
  params, model_state = runtime.init()
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=8, page_size=8,
                prefill_chunks=(8, 32))


def _constraint(engine, kind, value):
  return grammar.constraint(kind, value, "test", engine.tokenizer, engine.runtime.model_config.vocab_size)


def test_fifty_constrained_generations_validate_and_free_rows_are_unchanged(engine):
  constrained = [(_constraint(engine, "json", schema), schema) for schema in SCHEMAS]
  regex, choice = _constraint(engine, "regex", REGEX), _constraint(engine, "choice", CHOICES)
  plain_prompts = ["free text one", "and two"]
  plain = SamplingParams(max_tokens=12, temperature=0.8, seed=5, stop_token_ids=())
  alone = engine.generate(plain_prompts, plain)
  engine.generate(["warm"], SamplingParams(max_tokens=2, constraint=regex))  # compiles the processing step once
  jobs = [(constrained[i % 4][0], constrained[i % 4][1]) for i in range(40)] + [(regex, None)] * 5 + [(choice, None)] * 5
  settings = [SamplingParams(max_tokens=150, temperature=1.0, seed=i, constraint=c) for i, (c, _) in enumerate(jobs)]
  with counting_compiles() as compiles:
    done = engine.generate([f"record {i}:" for i in range(50)] + plain_prompts, settings + [plain, plain])
  assert compiles == []  # constrained and free rows share the compiled programs
  for (_, schema), result in zip(jobs[:40], done):
    assert result.finish_reason == "stop", result
    jsonschema.validate(json.loads(result.text), schema)
  assert all(re.fullmatch(REGEX, r.text) for r in done[40:45]), [r.text for r in done[40:45]]
  assert all(r.text in CHOICES for r in done[45:50]), [r.text for r in done[45:50]]
  assert len({r.text for r in done[:40]}) > 10  # sampled, not one answer repeated
  assert [r.tokens for r in done[50:]] == [r.tokens for r in alone]


def test_a_batch_without_constraints_never_runs_the_processing_step(engine, monkeypatch):
  ran = []
  real = engine.programs.run
  monkeypatch.setattr(engine.programs, "run", lambda kind, *a: ran.append(kind) or real(kind, *a))
  engine.generate(["plain"] * 3, SamplingParams(max_tokens=4, temperature=0.7, logprobs=True))
  assert "step_processed" not in ran and "step" in ran
  engine.generate(["plain"], SamplingParams(max_tokens=2, constraint=_constraint(engine, "choice", ["ab"])))
  assert "step_processed" in ran


def test_bad_constraints_name_their_field(engine):
  for kind, value in (("regex", "[a-"), ("json", "{not json"), ("json", {"type": "nonsense"}), ("choice", []),
                      ("grammar", "start: ???")):
    with pytest.raises(grammar.RequestError) as caught:
      grammar.constraint(kind, value, "response_format", engine.tokenizer, 512)
    assert caught.value.field == "response_format" and str(caught.value).startswith("response_format")
