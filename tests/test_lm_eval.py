"""An evaluation harness drives `jaxpar serve`: lm-eval's `local-completions` model on task
files written here (multiple choice by log-likelihood, and generate_until), against
lm-eval's own `hf` model on the `jaxpar convert jaxpar-to-hf` copy of the same weights:
per-item log-likelihoods within 1e-4, generations identical. Nothing is downloaded."""

import json
import os

import jax
import pytest

from jaxpar.inference import Engine
from tests.serving_setup import RunningServer, checkpoint_with_hf_copy

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task files are local: never ask the hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
lm_eval_tasks = pytest.importorskip("lm_eval.tasks")

QUESTIONS = [("the quick brown", ["fox", "dog", "runs"], 0), ("the lazy", ["dog", "fox jumps", "a"], 0),
             ("a fox", ["runs", "sleeps over the dog", "quick"], 0), ("the dog", ["sleeps", "the", "brown fox"], 0)]
PROMPTS = ["the quick brown fox", "a dog", "the lazy dog sleeps"]


def _tasks(directory):
  (directory / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                              for q, c, a in QUESTIONS))
  (directory / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": "x"}) + "\n" for p in PROMPTS))
  common = "dataset_path: json\ntest_split: train\n"
  (directory / "jaxpar_mc.yaml").write_text(
      f"task: jaxpar_mc\n{common}dataset_kwargs:\n  data_files: {directory / 'mc.jsonl'}\n"
      "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
      "metric_list:\n  - metric: acc\n")
  (directory / "jaxpar_gen.yaml").write_text(
      f"task: jaxpar_gen\n{common}dataset_kwargs:\n  data_files: {directory / 'gen.jsonl'}\n"
      "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: target\n"
      "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 10\n  do_sample: false\n  temperature: 0\n"
      "metric_list:\n  - metric: exact_match\n")
  return lm_eval_tasks.TaskManager(include_path=str(directory))


def _samples(model, model_args, tasks):
  results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["jaxpar_mc", "jaxpar_gen"],
                                    task_manager=tasks, log_samples=True, batch_size=1)
  by_doc = lambda task: sorted(results["samples"][task], key=lambda s: s["doc_id"])  # noqa: E731
  return ([[r[0] for r in s["resps"]] for s in by_doc("jaxpar_mc")],
          [s["resps"][0][0] for s in by_doc("jaxpar_gen")])


@pytest.mark.slow
def test_lm_eval_through_the_server_equals_transformers(tmp_path):
  ckpt, hf_dir, _ = checkpoint_with_hf_copy(tmp_path)
  tasks = _tasks(tmp_path)
  engine = Engine.from_checkpoint(ckpt, devices=jax.devices()[:1], slots=4, page_size=8, prefill_chunks=(8, 32))
  server = RunningServer(engine, "tiny")
  try:
    served = _samples("local-completions", {
        "base_url": f"{server.url}/v1/completions", "model": "tiny", "tokenizer": str(hf_dir),
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "add_bos_token": True,
        "max_length": 160, "num_concurrent": 2}, tasks)
  finally:
    server.close()
  reference = _samples("hf", {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu", "add_bos_token": True},
                       tasks)
  assert len(served[0]) == len(QUESTIONS) and len(served[1]) == len(PROMPTS)
  for ours, theirs in zip(served[0], reference[0]):
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs]
    assert [loglik for loglik, _ in ours] == pytest.approx([loglik for loglik, _ in theirs], abs=1e-4)
  assert served[1] == reference[1] and any(text for text in served[1])
