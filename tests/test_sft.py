"""Supervised chat fine-tuning: loss masks from real chat templates (written here, no download),
packing that changes no loss, and a tiny run on the bundled chat set that learns."""

import json
import re

import jax
import numpy as np
import pytest

from tests.helpers import small_config
from jaxpar.cli import main
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.errors import DataError
from jaxpar.data.chat import ChatRenderer, example_tokens
from jaxpar.data.chat_batches import pack_examples, read_rows
from jaxpar.runtime import Runtime
from jaxpar.objectives.lm import lm_loss
from jaxpar.train.trainer import Trainer

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN25 = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + "
          "'<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are "
          "a helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == "
          "\"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}"
          "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_MARKED = open(__import__("jaxpar.data.sources", fromlist=["x"]).bundled_path("chatml.jinja")).read()
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4."}]
BYTES = ByteTokenizer()

pytestmark = pytest.mark.optimized  # they train until the model learns


def _assistant_runs(tokens, mask) -> list[str]:
  """The text of each run of consecutive assistant tokens."""
  runs, current = [], []
  for token, marked in zip(tokens, mask):
    if marked:
      current.append(token)
    elif current:
      runs.append(BYTES.decode(current))
      current = []
  return runs + ([BYTES.decode(current)] if current else [])


@pytest.mark.parametrize("template, turn_end, bos", [
    (LLAMA3, "<|eot_id|>", "<|begin_of_text|>"), (QWEN25, "<|im_end|>\n", ""), (CHATML, "<|im_end|>\n", ""),
    (CHATML_MARKED, "<|im_end|>", "")], ids=["llama3", "qwen2.5", "chatml", "chatml-generation-markers"])
def test_only_assistant_tokens_carry_loss(template, turn_end, bos):
  renderer = ChatRenderer(template, bos_token=bos)
  tokens, mask = example_tokens({"messages": CONVERSATION}, renderer, BYTES)
  assert BYTES.decode(tokens) == renderer.render(CONVERSATION, False)  # the pieces are the whole render
  assert _assistant_runs(tokens, mask) == ["Hello!" + turn_end, "4." + turn_end]
  assert renderer.end_of_turn() == turn_end.strip()  # where `jaxpar generate --chat` stops
  # Everything else (system, user, headers, the bos) is context only.
  context = BYTES.decode(tokens[~mask])
  assert "Be brief." in context and "2+2?" in context and "Hello!" not in context and bos in context


def test_prompt_completion_and_unusable_templates():
  tokens, mask = example_tokens({"prompt": "Q: 1+1? A:", "completion": " 2"}, None, BYTES)
  assert BYTES.decode(tokens[mask]) == " 2" and tokens[-1] == BYTES.eos_id and mask[-1]
  counting = "{{ messages | length }}" + CHATML  # every prefix renders differently: no way to tell
  with pytest.raises(DataError, match="cannot be told apart") as error:
    example_tokens({"messages": CONVERSATION}, ChatRenderer(counting), BYTES)
  assert "\n" not in str(error.value)
  with pytest.raises(DataError, match="`messages`.*`prompt` and `completion`"):
    example_tokens({"text": "hi"}, None, BYTES)


def test_packing_gives_the_unpacked_loss():
  renderer = ChatRenderer(CHATML_MARKED)
  examples = [example_tokens(row, renderer, BYTES) for row in read_rows("bundled-chat")[:8]]
  packed, truncated = pack_examples(examples, 384)
  assert truncated == 0 and len(packed["inputs"]) <= len(examples) / 2  # several examples per row
  alone = [pack_examples([example], 384)[0] for example in examples]
  unpacked = {k: np.concatenate([a[k] for a in alone]) for k in packed}
  assert packed["loss_mask"].sum() == sum(mask[1:].sum() for _, mask in examples)
  config = small_config(mesh={"fsdp": 1}, model={"max_seq_len": 384})
  runtime = Runtime.from_config(config, jax.devices()[:1])
  params, model_state = runtime.init()
  objective = jax.jit(lm_loss(runtime.graphdef, z_loss=0.0, logits_chunk_len=0))
  with runtime.context():
    sums = [objective(params, model_state, batch)[1][0] for batch in (packed, unpacked)]
  np.testing.assert_allclose(sums[0]["ce_sum"], sums[1]["ce_sum"], rtol=1e-5)
  assert sums[0]["tokens"] == sums[1]["tokens"] == packed["loss_mask"].sum()


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
  """The tiny model trained on the bundled chat set (ChatML, one device), saved: (run dir, result)."""
  root = tmp_path_factory.mktemp("sft")
  config = small_config(mesh={"fsdp": 1}, model={"max_seq_len": 384},
                        data={"source": "bundled-chat", "format": "chat", "chat_template": "chatml", "seq_len": 384,
                              "global_batch_size": 4},
                        train={"steps": 60, "learning_rate": 1e-2, "warmup_steps": 3}, tmp_path=root)
  trainer = Trainer(config, devices=jax.devices()[:1])
  batches = trainer.batches()
  result = trainer.fit(batches=batches, show_progress=False)
  return root / "run", result, batches


def test_tiny_chat_run_lowers_assistant_loss(chat_run):
  _, result, batches = chat_run
  losses = [h["loss"] for h in result.history]
  assert np.mean(losses[-5:]) < 0.6 * losses[0]
  assert batches.truncated == 0
  assert 0 < result.history[0]["tokens"] < 4 * 384 / 2  # the loss is over assistant tokens only


def test_generate_chat_answers_in_the_learnt_format(chat_run, capsys):
  """`jaxpar generate --chat` renders the question as a ChatML user turn and prints only the
  answer, which ends where the model writes ChatML's end of turn."""
  run, _, _ = chat_run
  code = main(["generate", "--checkpoint", str(run), "--chat", "--prompt", "What is 3 plus 4?",
               "--slots", "1", "--max-tokens", "60", "--logprobs", "--temperature", "0"])
  answer = capsys.readouterr().out
  assert code == 0, answer
  # The bundled set answers sums as "A plus B is C.": the model learnt the form, and stopped at
  # <|im_end|> (60 tokens allowed); neither the prompt nor the turn's markup is printed.
  assert re.fullmatch(r"\d plus \d is \d+\.\n", answer), answer


def test_chat_config_errors_are_one_line(tmp_path, capsys):
  data = tmp_path / "chat.jsonl"
  data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
  template = tmp_path / "t.jinja"
  template.write_text("{{ messages | length }}" + CHATML)
  code = main(["train", "tiny", f"data.source={data}", "data.format=chat", f"data.chat_template={template}"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and "cannot be told apart" in err and len(err.splitlines()) == 1
  assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "Hi", "--system", "Be brief."]) == 2
  assert "--system needs --chat" in capsys.readouterr().err


def test_serve_and_export_keep_the_runs_chat_template(chat_run, tmp_path):
  """The run's data.chat_template (chatml) is the one renderer's everywhere: `serve` answers
  chats with it (the openai client drives it), --chat-template stands in where a run has none,
  and the HF export carries it, so transformers' apply_chat_template renders the same prompt."""
  import openai
  import transformers
  from starlette.testclient import TestClient

  from jaxpar.convert.hf import jaxpar_to_hf
  from jaxpar.data.sources import bundled_path
  from jaxpar.inference import Engine
  from jaxpar.inference.commands import run_chat_renderer
  from jaxpar.inference.server import build_app

  run, _, _ = chat_run
  renderer, _ = run_chat_renderer(run)
  with open(bundled_path("chatml.jinja")) as f:
    assert renderer.source == f.read()
  engine = Engine.from_checkpoint(run, slots=2, max_seq_len=128, prefill_chunks=(64,))
  turn = [{"role": "user", "content": "What is 3 plus 4?"}]
  with TestClient(build_app(engine, model_name="sft", chat=renderer)) as http:
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
    # No stop given: the answer ends at the template's end of turn, as `generate --chat` ends it.
    answer = client.chat.completions.create(model="sft", messages=turn, max_tokens=60, temperature=0)
    assert re.fullmatch(r"\d plus \d is \d+\.", answer.choices[0].message.content), answer
    assert answer.choices[0].finish_reason == "stop"
  with TestClient(build_app(engine, model_name="sft")) as http:  # the byte tokenizer has no template
    refused = http.post("/v1/chat/completions", json={"model": "sft", "messages": turn})
    assert refused.status_code == 400 and "--chat-template" in refused.json()["error"]["message"]
  out = jaxpar_to_hf(run, tmp_path / "hf")
  exported = transformers.AutoTokenizer.from_pretrained(out)
  assert exported.apply_chat_template(turn, add_generation_prompt=True, tokenize=False) == renderer.render(turn, True)
