"""Evaluation: eval loss falls while training and is logged; `jaxpar eval` on a checkpoint
gives training's number at that step; the eval step works on every layout; bits per byte
equals its definition computed by hand."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.config import replace
from jaxpar.data import byte_lengths, load_tokenizer
from jaxpar.mesh import logical_to_sharding
from jaxpar.runtime import Runtime
from jaxpar.train.eval_command import evaluate_saved_run
from jaxpar.train.evaluator import Evaluator
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config, tensorboard_scalars
from tests.test_data import _train_hf_tokenizer

ROOT = Path(__file__).parent.parent
MODEL = dict(embed_dim=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp("eval")
  config = small_config(mesh={"fsdp": 4, "tensor": 2}, model=MODEL,
                        data={"seq_len": 32, "global_batch_size": 16, "holdout": 0.05},
                        train={"steps": 12, "warmup_steps": 2, "peak_flops_per_device": 1e9},
                        tmp_path=tmp_path, checkpoint={"every_steps": 4, "keep_last": None})
  config = replace(config, eval={"every_steps": 4, "steps": 3})
  trainer = Trainer(config)
  return config, trainer, trainer.fit(show_progress=False)


def _evals(result) -> dict[int, float]:
  return {h["step"]: h["eval/heldout/loss"] for h in result.history if "eval/heldout/loss" in h}


def test_eval_loss_falls_and_goes_to_jsonl_tensorboard_and_summary(trained):
  config, _, result = trained
  evals = _evals(result)
  assert sorted(evals) == [4, 8, 12] and evals[12] < evals[8] < evals[4], evals
  run_dir = Path(config.train.run_dir)
  records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
  assert records[12]["eval/heldout/loss"] == evals[12]
  assert records[12]["eval/heldout/perplexity"] == pytest.approx(math.exp(evals[12]))
  assert "step_time_s" not in records[9] and "step_time_s" in records[10]  # the eval is not step time
  scalars = tensorboard_scalars(run_dir)
  assert scalars["eval/heldout/loss"][12] == pytest.approx(evals[12], rel=1e-6)
  assert scalars["eval/heldout/bits_per_byte"][12] == pytest.approx(records[12]["eval/heldout/bits_per_byte"], rel=1e-6)
  assert sorted(scalars["train/loss"]) == list(range(1, 13))
  assert result.summary["eval_step"] == 12 and result.summary["eval"]["eval/heldout/loss"] == evals[12]


def test_jaxpar_eval_of_a_checkpoint_equals_the_training_eval(trained, tmp_path):
  config, _, result = trained
  checkpoints = Path(config.train.run_dir) / "checkpoints"
  for step in (8, 12):
    out = evaluate_saved_run(checkpoints / str(step))
    assert out["step"] == step and out["results"]["heldout"]["loss"] == _evals(result)[step]
  # On another mesh (it replaces the saved fsdp 4 x tensor 2): the same windows, another summation order.
  other = evaluate_saved_run(checkpoints, mesh=["data=2", "mesh.fsdp=4"])
  assert other["results"]["heldout"]["loss"] == pytest.approx(_evals(result)[12], rel=1e-5)
  # The command line takes the mesh as generate and serve do: mesh.AXIS=SIZE items.
  assert main(["eval", str(checkpoints), "mesh.data=2", "mesh.fsdp=4", "--output", str(tmp_path / "e.json")]) == 0
  assert json.loads((tmp_path / "e.json").read_text())["results"] == other["results"]


def test_eval_step_under_context_parallelism_equals_fsdp(trained):
  config, trainer, result = trained
  want = trainer.evaluator().run(result.state.params, result.state.model_state)
  split = replace(config, mesh={"fsdp": 4, "tensor": 1, "context": 2},
                  parallel={"context": {"attention": "ring"}})
  runtime = Runtime.from_config(split)
  params = jax.device_put(jax.device_get(result.state.params), runtime.param_shardings)
  batch = logical_to_sharding(("batch", "length"), None, runtime.mesh, runtime.rules)
  got = Evaluator(split, runtime, load_tokenizer("byte"), runtime.param_shardings,
                  runtime.model_state_shardings, batch).run(params)
  for key in ("loss", "bits_per_byte"):
    assert got["heldout"][key] == pytest.approx(want["heldout"][key], rel=1e-5)
  assert got["heldout"]["tokens"] == want["heldout"]["tokens"]


def test_bits_per_byte_by_hand(tmp_path):
  text = "Héllo wörld: a short text, scored by hand. 日本"
  data = text.encode()
  (tmp_path / "short.txt").write_text(text)
  config = small_config(mesh={"fsdp": 1}, model=MODEL, data={"seq_len": len(data)},
                        train={"logits_chunk_len": 0})
  config = replace(config, eval={"sets": [str(tmp_path / "short.txt")]})
  runtime = Runtime.from_config(config, jax.devices()[:1])
  params, _ = runtime.init()
  batch = logical_to_sharding(("batch", "length"), None, runtime.mesh, runtime.rules)
  got = Evaluator(config, runtime, load_tokenizer("byte"), runtime.param_shardings, runtime.model_state_shardings,
                  batch, batch_size=1).run(params)["short"]
  # One window: the text's bytes predict the next byte, the last one predicts eos.
  tokens = np.append(np.frombuffer(data, np.uint8).astype(np.int32), 256)
  with runtime.context():
    logits, _ = runtime.merge(params)(jnp.asarray(tokens[None, :-1]))
  logp = np.asarray(jax.nn.log_softmax(np.asarray(logits[0], np.float64), axis=-1))
  nats = -logp[np.arange(len(data)), tokens[1:]].sum()
  assert got["tokens"] == len(data)
  assert got["loss"] == pytest.approx(nats / len(data), rel=1e-5)
  # Predicted text: every byte but the first (eos stands for no text).
  assert got["bits_per_byte"] == pytest.approx(nats / math.log(2) / (len(data) - 1), rel=1e-5)


def test_byte_lengths_add_up_to_the_text(tmp_path):
  _train_hf_tokenizer(tmp_path / "tokenizer.json")
  texts = ["the quick brown fox", "naïve café über 日本語 🎉", "  spaces\tand\nlines  "]
  for tokenizer in (load_tokenizer("byte"), load_tokenizer(str(tmp_path / "tokenizer.json"))):
    table = byte_lengths(tokenizer)
    assert table[tokenizer.eos_id] == 0
    for text in texts:
      assert table[tokenizer.encode(text)].sum() == len(text.encode()), (tokenizer, text)


@pytest.mark.slow
def test_cli_eval_prints_the_training_numbers_and_bad_sources_are_one_line(trained, tmp_path):
  config, _, result = trained
  run_dir = config.train.run_dir
  out = subprocess.run([sys.executable, "-m", "jaxpar", "eval", run_dir, "--output", str(tmp_path / "e.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert f"heldout: loss {_evals(result)[12]:.4f}" in out.stdout
  assert json.loads((tmp_path / "e.json").read_text())["results"]["heldout"]["loss"] == _evals(result)[12]
  assert re.search(r"eval heldout .* 3/3", out.stderr), out.stderr  # a bar per set, on stderr
  bad = subprocess.run([sys.executable, "-m", "jaxpar", "eval", run_dir, str(tmp_path / "none-*.jsonl")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  last = bad.stderr.strip().splitlines()[-1]
  assert bad.returncode == 2 and last.startswith("error: data source") and "none-*.jsonl" in last, bad.stderr
  assert "Traceback" not in bad.stderr


def test_the_default_config_evaluates_a_novel_it_never_trained_on(tmp_path, capsys):
  run = tmp_path / "tiny"
  assert main(["train", "tiny", "train.steps=2", "train.sample_tokens=0", f"train.run_dir={run}", "--no-progress"]) == 0
  capsys.readouterr()
  assert main(["eval", str(run), "--steps", "2"]) == 0
  out = capsys.readouterr().out
  assert re.search(r"bundled-heldout: loss \d+\.\d+ +perplexity", out), out


def test_end_of_run_lines_report_the_final_eval_and_what_a_mixture_drew(tmp_path):
  from jaxpar.train.metrics import summary_lines
  (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
  config = small_config(data={"sources": {"web": {"path": str(tmp_path / "a.jsonl"), "weight": 3},
                                          "books": {"path": str(tmp_path / "a.jsonl"), "weight": 1},
                                          "wiki": {"path": str(tmp_path / "a.jsonl"), "weight": 0}}})
  summary = {"eval_step": 40, "eval": {"eval/wiki/loss": 2.5, "eval/wiki/perplexity": math.exp(2.5),
                                       "eval/wiki/bits_per_byte": 3.6, "eval/wiki/tokens": 100.0},
             "data_proportions": {"web": 0.7421875, "books": 0.2578125}}
  assert summary_lines(summary, config) == [
      "eval at step 40: wiki loss 2.500 ppl 12.18 bpb 3.600",
      "data drawn: web 74.2% (weight 75.0%), books 25.8% (weight 25.0%)"]
