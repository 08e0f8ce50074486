"""Generating from a converted Hugging Face model (its tokenizer carried along) matches
`transformers` token for token; `jaxpar generate` streams, and writes JSONL for a file."""

import json
import shutil

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.convert.hf import hf_to_jaxpar, jaxpar_to_hf
from jaxpar.inference import Engine, SamplingParams
from tests.helpers import counting_compiles
from tests.test_data import _train_hf_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """A random-weight HF Llama with a locally trained BPE tokenizer, converted to jaxpar."""
  root = tmp_path_factory.mktemp("hf_generate")
  hf_dir = root / "hf"
  hf_dir.mkdir()
  tokenizer = _train_hf_tokenizer(hf_dir / "tokenizer.json", special_tokens=("<|endoftext|>", "<s>"))
  (hf_dir / "tokenizer_config.json").write_text(json.dumps({
      "add_bos_token": True, "bos_token": "<s>", "eos_token": "<|endoftext|>", "chat_template": TEMPLATE}))
  config = transformers.LlamaConfig(
      vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=128, bos_token_id=tokenizer.token_to_id("<s>"),
      eos_token_id=tokenizer.token_to_id("<|endoftext|>"))
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(0.2 * torch.randn_like(p))
  model.save_pretrained(hf_dir)
  hf_to_jaxpar(hf_dir, root / "jaxpar")
  return root, model, tokenizer


def test_converted_model_generates_what_transformers_does(converted):
  root, model, tokenizer = converted
  engine = Engine.from_checkpoint(root / "jaxpar", slots=2, page_size=8, prefill_chunks=(8,))
  assert engine.tokenizer.chat_template == TEMPLATE  # carried with the checkpoint
  prompts = ["the quick brown fox", "a dog"]
  ids = [engine.encode(p) for p in prompts]
  for prompt, row in zip(prompts, ids):  # bos first, as tokenizer_config.json asks
    assert row == [tokenizer.token_to_id("<s>")] + tokenizer.encode(prompt, add_special_tokens=False).ids
  ours = engine.generate(prompts, SamplingParams(max_tokens=20))
  for row, result in zip(ids, ours):
    with torch.no_grad():
      out = model.generate(torch.tensor([row]), max_new_tokens=20, do_sample=False,
                           eos_token_id=model.config.eos_token_id, pad_token_id=0)
    theirs = out[0, len(row):].tolist()
    if theirs and theirs[-1] == model.config.eos_token_id:
      theirs = theirs[:-1]  # our completion leaves the stop token out
    assert result.tokens == theirs
  jaxpar_to_hf(root / "jaxpar", root / "back")  # and the tokenizer goes back out with the weights
  assert json.loads((root / "back" / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE
  assert (root / "back" / "tokenizer.json").read_bytes() == (root / "hf" / "tokenizer.json").read_bytes()


def _hf_greedy(model, tokenizer, prompt: str, count: int) -> tuple[list[int], list[float]]:
  """transformers' greedy tokens after `prompt` (bos first, as tokenizer_config.json asks; cut
  at eos) and each one's log-probability."""
  ids = [tokenizer.token_to_id("<s>")] + tokenizer.encode(prompt, add_special_tokens=False).ids
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, output_scores=True,
                         return_dict_in_generate=True, eos_token_id=model.config.eos_token_id, pad_token_id=0)
  tokens = out.sequences[0, len(ids):].tolist()
  logprobs = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, tokens)]
  if tokens and tokens[-1] == model.config.eos_token_id:
    tokens, logprobs = tokens[:-1], logprobs[:-1]
  return tokens, logprobs


def test_cli_generate_streams_and_writes_jsonl(converted, tmp_path, capsys):
  root, model, tokenizer = converted
  common = ["generate", "--checkpoint", str(root / "jaxpar"), "--slots", "2", "--max-tokens", "6", "--temperature", "0"]
  assert main([*common, "--prompt", "the dog"]) == 0
  streamed = capsys.readouterr().out
  want, _ = _hf_greedy(model, tokenizer, "the dog", 6)
  assert streamed == "the dog" + tokenizer.decode(want) + "\n"  # greedy: transformers' text
  # Without --temperature / --top-p: the run's sample settings (0.8, 0.95 here), as serve's defaults.
  sampled = [main([*common[:-2], "--prompt", "the dog", *extra]) or capsys.readouterr().out
             for extra in ([], ["--temperature", "0.8", "--top-p", "0.95"])]
  assert sampled[0] == sampled[1] and sampled[0].startswith("the dog"), sampled
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt": "the fox", "temperature": 0.9, "seed": 3}\nthe lazy dog\n')
  assert main([*common, "--prompts-file", str(prompts), "--output", str(tmp_path / "out.jsonl"), "--logprobs"]) == 0
  rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert [r["prompt"] for r in rows] == ["the fox", "the lazy dog"]
  assert all(len(r["logprobs"]) == len(r["tokens"]) <= 6 and r["finish_reason"] in ("stop", "length")
             for r in rows)
  tokens, logprobs = _hf_greedy(model, tokenizer, "the lazy dog", 6)
  assert rows[1]["tokens"] == tokens and rows[1]["text"] == tokenizer.decode(tokens)
  np.testing.assert_allclose(rows[1]["logprobs"], logprobs, atol=1e-4)


def test_cli_generate_bad_input_is_one_line(converted, capsys):
  root, _, _ = converted
  assert main(["generate", "--checkpoint", str(root / "jaxpar"), "--prompt", "x", "mesh.tensr=2"]) == 2
  assert "'mesh.tensr=2' is not a mesh size" in capsys.readouterr().err
  assert main(["generate", "--checkpoint", str(root / "jaxpar")]) == 2
  assert "give --prompt TEXT or --prompts-file FILE" in capsys.readouterr().err
  # Past the context (128 tokens): refused as serve refuses it, before anything compiles.
  with counting_compiles() as compiled:
    assert main(["generate", "--checkpoint", str(root / "jaxpar"), "--prompt", "the dog", "--max-tokens", "200"]) == 2
  err = capsys.readouterr().err
  assert "--prompt: max_tokens=200 is out of range: this model's maximum context length is 128" in err, err
  assert compiled == [], compiled


def test_cli_generate_chat_without_a_template_refuses_before_compiling(converted, tmp_path, capsys):
  root, _, _ = converted
  run = tmp_path / "no-template"
  shutil.copytree(root / "jaxpar", run)
  for path in run.rglob("tokenizer_config.json"):
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "chat_template"}))
  for path in run.rglob("chat_template.jinja"):
    path.unlink()
  with counting_compiles() as compiled:
    assert main(["generate", "--checkpoint", str(run), "--chat", "--prompt", "hi"]) == 2
  assert "has no chat template" in capsys.readouterr().err and compiled == [], compiled


@pytest.mark.parametrize("style", ["llama3", "llama2"])
def test_prompts_get_the_bos_transformers_gives_them(style, tmp_path):
  """Llama 3 adds its BOS in tokenizer.json's post-processor, Llama 2 by add_bos_token:
  `jaxpar generate` encodes as transformers does and continues token for token alike."""
  from tests.serving_setup import checkpoint_with_hf_copy
  ckpt, hf_dir, model = checkpoint_with_hf_copy(tmp_path, style, seed=1)
  tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
  prompts = ["the quick brown fox", "a dog"]
  (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
  assert main(["generate", "--checkpoint", str(ckpt), "--slots", "2", "--max-tokens", "12", "--temperature", "0",
               "--prompts-file", str(tmp_path / "prompts.txt"), "--output", str(tmp_path / "out.jsonl")]) == 0
  rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
  for prompt, row in zip(prompts, rows):
    ids = tokenizer(prompt)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    with torch.no_grad():
      out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    theirs = out[0, len(ids):].tolist()
    assert row["tokens"] == [t for t in theirs if t != tokenizer.eos_token_id][:len(row["tokens"])]
    assert len(row["tokens"]) == len(theirs) - (theirs[-1] == tokenizer.eos_token_id)
