"""Every request field `jaxpar serve` accepts, checked against `transformers` on the
exported HF copy of the same weights or by hand, through the official `openai` client
(raw HTTP for what the client will not send)."""

import json
import re
import types

import jax
import numpy as np
import pytest

from jaxpar.inference import Engine
from jaxpar.inference import openai_api as api
from tests.serving_setup import RunningServer, checkpoint_with_hf_copy, hf_logprobs

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NAME = "tiny"
PROMPT = "the quick brown fox"

# Each accepted field with a value that is wrong for it.
COMMON = {"model": 5, "temperature": -1, "top_p": 0, "top_k": -2, "seed": "x", "stop": 5, "stop_token_ids": [99999],
          "ignore_eos": "maybe", "min_tokens": -1, "stream": "x", "stream_options": 5,
          "stream_options.include_usage": "x", "stream_options.continuous_usage_stats": "x", "n": 0,
          "presence_penalty": 3, "frequency_penalty": -3, "repetition_penalty": 0, "logit_bias": {"5": 200},
          "user": 5, "add_special_tokens": "x", "return_tokens_as_token_ids": "x", "response_format": 5, "response_format.type": "xml",
          "response_format.json_schema": 5, "response_format.json_schema.name": 5,
          "response_format.json_schema.schema": 5, "response_format.json_schema.description": 5,
          "response_format.json_schema.strict": "x", "structured_outputs": 5, "structured_outputs.json": 5,
          "structured_outputs.regex": "[a-", "structured_outputs.choice": [], "structured_outputs.grammar": "start: ???",
          "guided_json": 5, "guided_regex": "[a-", "guided_choice": [], "guided_grammar": "start: ???",
          "speculative": "x"}
COMPLETION = {**COMMON, "prompt": {"a": 1}, "max_tokens": -1, "logprobs": 21, "echo": "x", "suffix": "tail", "best_of": 3}
CHAT = {**COMMON, "messages": [], "max_tokens": 0, "max_completion_tokens": 0, "logprobs": "x", "top_logprobs": 21,
        "add_generation_prompt": "x"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  ckpt, hf_dir, model = checkpoint_with_hf_copy(tmp_path_factory.mktemp("fields"))
  engine = Engine.from_checkpoint(ckpt, devices=jax.devices()[:1], slots=4, page_size=8, prefill_chunks=(8, 32))
  server = RunningServer(engine, NAME)
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  yield types.SimpleNamespace(server=server, client=server.client, model=model, tokenizer=tokenizer,
                              ids=tokenizer(PROMPT)["input_ids"], text=engine.tokenizer.token_text)
  server.close()


def _nested(field: str, value) -> dict:
  """{"a.b": v} as the body {"a": {"b": v}} (a json_schema response_format where one is needed)."""
  head, *path = field.split(".")
  for part in reversed(path):
    value = {part: value}
  if head == "response_format" and path:
    value = {"type": "json_schema", **value}
  return {head: value}


def _greedy(model, ids, count, adjust=None):
  """transformers' greedy continuation, each step's logits adjusted by adjust(logits, context)."""
  ids = list(ids)
  for _ in range(count):
    with torch.no_grad():
      logits = model(torch.tensor([ids])).logits[0, -1].double().numpy()
    ids.append(int(np.argmax(adjust(logits, ids) if adjust else logits)))
  return ids


def test_every_accepted_field_is_listed_and_a_bad_value_is_a_400_naming_it(served):
  assert sorted(api.accepted_fields(api.CompletionRequest)) == sorted(COMPLETION)
  assert sorted(api.accepted_fields(api.ChatRequest)) == sorted(CHAT)
  for path, fields, base in (("/v1/completions", COMPLETION, {"prompt": "hi"}),
                             ("/v1/chat/completions", CHAT, {"messages": [{"role": "user", "content": "hi"}]})):
    for field, bad in fields.items():
      status, body, _ = served.server.post(path, {"model": NAME, "max_tokens": 2, **base, **_nested(field, bad)})
      assert (status, body["error"]["param"]) == (400, field), (path, field, body)


def test_unknown_fields_are_ignored_logged_once_and_named_in_a_header(served, caplog):
  request = {"model": NAME, "prompt": "hi", "max_tokens": 2, "frobnicate": 1,
             "stream_options": {"include_usage": True, "zap": 2}}
  with caplog.at_level("WARNING", logger="jaxpar.serve"):
    for _ in range(2):
      status, body, headers = served.server.post("/v1/completions", request)
      assert status == 200 and body["usage"]["completion_tokens"] >= 1
      assert headers[api.IGNORED_HEADER] == "frobnicate, stream_options.zap"
  warned = [r.getMessage().split("'")[1] for r in caplog.records if r.name == "jaxpar.serve"]
  assert warned == ["frobnicate", "stream_options.zap"]


def test_echo_scores_the_prompt_as_a_full_forward_does(served):
  ids, client = served.ids, served.client
  assert ids[0] == served.tokenizer.bos_token_id  # the post-processor's BOS, as transformers adds it
  expected = hf_logprobs(served.model, ids)
  scored = client.completions.create(model=NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
  block = scored.choices[0].logprobs
  assert block.tokens == [served.text(t) for t in ids] and block.token_logprobs[0] is None
  np.testing.assert_allclose(block.token_logprobs[1:], [expected[i - 1, ids[i]] for i in range(1, len(ids))],
                             atol=1e-4)
  assert scored.usage.prompt_tokens == len(ids) and scored.usage.completion_tokens == 0
  # As an evaluation harness asks: token ids, one generated token; its top alternative is the argmax.
  harness = client.completions.create(model=NAME, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
  block = harness.choices[0].logprobs
  best = int(np.argmax(expected[-1]))
  assert block.tokens[-1] == served.text(best) and len(block.tokens) == len(ids) + 1
  assert block.top_logprobs[-1] == pytest.approx({served.text(best): expected[-1, best]}, abs=1e-4)
  assert harness.choices[0].text.startswith(served.tokenizer.decode(ids, skip_special_tokens=True))


def test_token_id_prompts_equal_string_prompts_and_transformers(served):
  client, other = served.client, "a fox runs"
  texts = client.completions.create(model=NAME, prompt=[PROMPT, other], max_tokens=6, temperature=0)
  ids = client.completions.create(model=NAME, prompt=[served.ids, served.tokenizer(other)["input_ids"]],
                                  max_tokens=6, temperature=0)
  one = client.completions.create(model=NAME, prompt=served.ids, max_tokens=6, temperature=0)
  assert [c.index for c in ids.choices] == [0, 1]
  assert [c.text for c in texts.choices] == [c.text for c in ids.choices]
  assert one.choices[0].text == ids.choices[0].text
  expected = _greedy(served.model, served.ids, 6)[len(served.ids):]
  if served.tokenizer.eos_token_id in expected:
    expected = expected[:expected.index(served.tokenizer.eos_token_id)]
  assert one.choices[0].text == served.tokenizer.decode(expected, skip_special_tokens=True)


def test_n_choices_with_a_seed_are_reproducible(served):
  ask = lambda: served.client.completions.create(model=NAME, prompt=PROMPT, n=4, seed=7, temperature=1.0,  # noqa: E731
                                                 max_tokens=8, extra_body={"ignore_eos": True})
  first, again = ask(), ask()
  assert [c.text for c in first.choices] == [c.text for c in again.choices]
  assert len({c.text for c in first.choices}) > 1 and [c.index for c in first.choices] == [0, 1, 2, 3]
  assert first.usage.completion_tokens == 32 and first.usage.prompt_tokens == len(served.ids)
  other = served.client.completions.create(model=NAME, prompt=PROMPT, n=4, seed=8, temperature=1.0, max_tokens=8,
                                           extra_body={"ignore_eos": True})
  assert [c.text for c in other.choices] != [c.text for c in first.choices]


def test_ignore_eos_min_tokens_and_logit_bias(served):
  client, eos = served.client, served.tokenizer.eos_token_id
  def ask(extra_body=None, **extra):
    return client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0, **extra,
                                     extra_body={"return_tokens_as_token_ids": True, **(extra_body or {})})
  forced_eos = {"logit_bias": {str(eos): 100}}
  stopped = ask(**forced_eos)
  assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", 0)
  ran = ask(extra_body={"ignore_eos": True}, **forced_eos)
  assert (ran.choices[0].finish_reason, ran.usage.completion_tokens) == ("length", 5)
  held = ask(extra_body={"min_tokens": 3}, **forced_eos)
  assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 3)
  # -100 bans the greedy token: the next best (by transformers' logits) comes instead, and never the banned one.
  last = hf_logprobs(served.model, served.ids)[-1]
  best, second = np.argsort(-last)[:2]
  banned = ask(logit_bias={str(best): -100})
  assert banned.choices[0].logprobs.tokens[0] == f"token_id:{second}"
  assert f"token_id:{best}" not in banned.choices[0].logprobs.tokens


def test_stop_strings_and_stop_token_ids(served):
  """Biased toward " dog" (then " fox"), the text is known by hand."""
  dog, fox = (served.tokenizer(w, add_special_tokens=False)["input_ids"] for w in (" dog", " fox"))
  assert len(dog) == len(fox) == 1
  bias = {str(dog[0]): 100, str(fox[0]): 90}
  ask = lambda **extra: served.client.completions.create(  # noqa: E731
      model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias=bias, **extra)
  assert ask().choices[0].text == " dog dog dog dog"
  cut = ask(stop=["g d", "zebra"])
  assert (cut.choices[0].text, cut.choices[0].finish_reason) == (" do", "stop")
  ended = ask(extra_body={"stop_token_ids": dog})
  assert (ended.choices[0].text, ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("", "stop", 0)
  held = ask(extra_body={"stop_token_ids": dog, "min_tokens": 2})
  assert (held.choices[0].text, held.choices[0].finish_reason) == (" fox fox", "stop")
  # A stop string is not looked for before min_tokens either.
  late = ask(stop=[" dog"], extra_body={"min_tokens": 2})
  assert late.choices[0].text == " dog dog"


def test_penalties_follow_the_hand_computation(served):
  presence, frequency, repetition = 0.8, 0.6, 1.5

  def penalize(logits, context):
    logits = logits.copy()
    seen = sorted(set(context))
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
    output = context[len(served.ids):]
    for token in set(output):
      logits[token] -= presence + frequency * output.count(token)
    return logits
  expected = _greedy(served.model, served.ids, 8, penalize)[len(served.ids):]
  got = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                         presence_penalty=presence, frequency_penalty=frequency,
                                         extra_body={"repetition_penalty": repetition, "ignore_eos": True,
                                                     "return_tokens_as_token_ids": True})
  assert got.choices[0].logprobs.tokens == [f"token_id:{t}" for t in expected]
  # transformers' own repetition penalty is the same rule.
  rule = transformers.RepetitionPenaltyLogitsProcessor(repetition)
  theirs = _greedy(served.model, served.ids, 8,
                   lambda logits, ids: rule(torch.tensor([ids]), torch.tensor(logits[None]))[0].numpy())
  ours = served.client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                          extra_body={"repetition_penalty": repetition, "ignore_eos": True,
                                                      "return_tokens_as_token_ids": True})
  assert ours.choices[0].logprobs.tokens == [f"token_id:{t}" for t in theirs[len(served.ids):]]


def test_streams_carry_usage_and_match_whole_responses(served):
  client = served.client
  whole = client.completions.create(model=NAME, prompt=PROMPT, n=2, seed=3, temperature=1.0, max_tokens=6, echo=True,
                                    logprobs=2)
  chunks = list(client.completions.create(
      model=NAME, prompt=PROMPT, n=2, seed=3, temperature=1.0, max_tokens=6, echo=True, logprobs=2, stream=True,
      stream_options={"include_usage": True, "continuous_usage_stats": True}))
  texts = ["", ""]
  for chunk in chunks:
    for choice in chunk.choices:
      texts[choice.index] += choice.text
  assert texts == [c.text for c in whole.choices]
  assert all(c.usage is not None for c in chunks) and not chunks[-1].choices
  counts = [c.usage.completion_tokens for c in chunks]
  last = chunks[-1].usage
  assert counts == sorted(counts) and (last.prompt_tokens, last.completion_tokens) == (
      whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_chat_logprobs_and_the_template_bos(served):
  messages = [{"role": "user", "content": "a fox"}]
  ids = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
  assert ids.count(served.tokenizer.bos_token_id) == 1  # the template wrote it
  status, tokenized, _ = served.server.post("/tokenize", {"messages": messages, "add_special_tokens": True})
  assert tokenized["tokens"] == ids
  reply = served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0,
                                                logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
  assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 3
  expected = hf_logprobs(served.model, ids)[-1]
  first = reply.choices[0].logprobs.content[0]
  top2 = np.argsort(-expected)[:2]
  assert first.logprob == pytest.approx(expected[top2[0]], abs=1e-4)
  assert [t.token for t in first.top_logprobs] == [f"token_id:{t}" for t in top2]
  np.testing.assert_allclose([t.logprob for t in first.top_logprobs], expected[top2], atol=1e-4)


def test_tokenize_detokenize_and_tokenizer_info(served):
  server, tokenizer = served.server, served.tokenizer
  status, body, _ = server.post("/tokenize", {"prompt": PROMPT, "return_token_strs": True})
  assert status == 200 and body["tokens"] == served.ids and body["count"] == len(served.ids)
  assert body["max_model_len"] == 160 and body["token_strs"][0] == tokenizer.bos_token
  plain = server.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False})[1]["tokens"]
  assert plain == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
  assert server.post("/detokenize", {"tokens": plain})[1] == {"prompt": PROMPT}
  assert server.post("/detokenize", {"tokens": [10 ** 6]})[1]["error"]["param"] == "tokens"
  status, info = server.get("/tokenizer_info")
  assert status == 200 and json.loads(info)["eos_token"] == "<|end_of_text|>"
  models = served.client.models.list().data
  assert [(m.id, m.model_extra["max_model_len"]) for m in models] == [(NAME, 160)]


def test_structured_output_fields_through_the_client(served):
  client = served.client
  schema = {"type": "object", "properties": {"animal": {"enum": ["fox", "dog"]},
                                            "legs": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["animal", "legs"], "additionalProperties": False}
  fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
  reply = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a pet"}], max_tokens=40,
                                         temperature=1.0, seed=1, n=3, response_format=fmt)
  for choice in reply.choices:
    value = json.loads(choice.message.content)
    assert value["animal"] in ("fox", "dog") and 0 <= value["legs"] <= 9
  close = served.tokenizer("}", add_special_tokens=False)["input_ids"][0]
  # Pushed toward "}" everywhere: free, it would be "}}}}"; constrained, it is a JSON object.
  obj = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, logit_bias={str(close): 50},
                                  extra_body={"response_format": {"type": "json_object"}})
  assert json.loads(obj.choices[0].text) == {}
  free = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(close): 50})
  assert free.choices[0].text == "}}}}"
  for extra, check in (({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
                       ({"structured_outputs": {"regex": "[a-c]{2}[0-9]"}}, re.compile("[a-c]{2}[0-9]").fullmatch),
                       ({"guided_json": {"type": "boolean"}}, lambda t: t in ("true", "false"))):
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=2, n=2,
                                    extra_body=extra)
    assert all(check(c.text) for c in got.choices), (extra, [c.text for c in got.choices])
