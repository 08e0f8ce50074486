"""EleutherAI's lm-evaluation-harness on a jaxpar run, in process, against the harness's own
Hugging Face model on the exported weights: per-item log-likelihoods agree within 1e-4 and
greedy generations are identical, on local tasks (task YAMLs over JSON files; nothing is
downloaded): multiple choice, generate_until and a rolling log-likelihood longer than the
model's context."""

import json

import jax
import pytest

pytest.importorskip("lm_eval")  # the `eval` extra; `dev` installs it, so CI runs this

from jaxpar.convert.hf import jaxpar_to_hf  # noqa: E402
from jaxpar.data import bundled_path, read_documents  # noqa: E402
from jaxpar.weights import open_run  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402
from tests.helpers import small_config  # noqa: E402

pytestmark = pytest.mark.slow

MC = [{"question": q, "choices": c, "answer": a} for q, c, a in [
    ("It is a truth universally", [" acknowledged", " denied", " forgotten"], 0),
    ("Mr. Darcy was", [" proud", " a horse", " tall and handsome"], 0),
    ("She could not help", [" laughing", " seeing it", " the table"], 1),
    ("Elizabeth", [" Bennet", " walked", " was silent"], 0)]]
GEN = [{"prompt": p, "target": t} for p, t in [
    ("It is a truth universally acknowledged, that", " a single man"), ("Mr. Bennet", " said"),
    ("My dear", " Mr. Bennet"), ("\"Oh!", " yes")]]


def _task(folder, name, data, **fields):
  (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in data))
  lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs:",
           f"  data_files: {{test: {folder / f'{name}.jsonl'}}}", "test_split: test"]
  lines += [f"{k}: {json.dumps(v)}" for k, v in fields.items()]
  (folder / f"{name}.yaml").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, monkeypatch_module):
  tmp = tmp_path_factory.mktemp("harness")
  monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
  import datasets
  monkeypatch_module.setattr(datasets.config, "HF_DATASETS_CACHE", tmp / "hf-cache")
  # A small BPE tokenizer trained here, with the settings file Hugging Face loads it by.
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(read_documents(bundled_path())[:40], trainers.BpeTrainer(
      vocab_size=480, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  (tmp / "tok").mkdir()
  tokenizer.save(str(tmp / "tok" / "tokenizer.json"))
  (tmp / "tok" / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "model_max_length": 128}))
  config = small_config(mesh={"fsdp": 1}, model={"max_seq_len": 128},
                        data={"tokenizer": str(tmp / "tok" / "tokenizer.json"), "seq_len": 64,
                              "global_batch_size": 16},
                        train={"steps": 40, "learning_rate": 1e-2, "warmup_steps": 5,
                               "peak_flops_per_device": 1e9}, tmp_path=tmp)
  Trainer(config, devices=jax.devices()[:1]).fit(show_progress=False)
  hf_dir = jaxpar_to_hf(config.train.run_dir, tmp / "hf")
  tasks = tmp / "tasks"
  tasks.mkdir()
  _task(tasks, "local_mc", MC, output_type="multiple_choice", doc_to_text="{{question}}",
        doc_to_choice="{{choices}}", doc_to_target="{{answer}}", metric_list=[{"metric": "acc"}])
  _task(tasks, "local_gen", GEN, output_type="generate_until", doc_to_text="{{prompt}}",
        doc_to_target="{{target}}", generation_kwargs={"until": ["."], "max_gen_toks": 10, "do_sample": False},
        metric_list=[{"metric": "exact_match"}])
  long_texts = [{"text": d[:1500]} for d in read_documents(bundled_path())[50:53]]  # several windows each
  _task(tasks, "local_rolling", long_texts, output_type="loglikelihood_rolling", doc_to_text="",
        doc_to_target="{{text}}", metric_list=[{"metric": "word_perplexity"}])
  return config, hf_dir, tasks


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as patch:
    yield patch


TASKS = ["local_mc", "local_gen", "local_rolling"]


def _samples(model, tasks_dir, **options):
  import lm_eval
  from lm_eval.tasks import TaskManager
  results = lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=TaskManager(include_path=str(tasks_dir)),
                                    log_samples=True, bootstrap_iters=0, **options)
  return {task: sorted(results["samples"][task], key=lambda s: s["doc_id"]) for task in TASKS}


def test_in_process_harness_matches_transformers_item_by_item(setup):
  from jaxpar.train.harness import JaxparLM
  config, hf_dir, tasks = setup
  theirs = _samples("hf", tasks, model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
                    batch_size=1)
  run = open_run(config.train.run_dir, {"fsdp": 1}, devices=jax.devices()[:1])
  ours = _samples(JaxparLM(run=run, batch_size=3), tasks)
  compared = 0
  for task in ("local_mc", "local_rolling"):
    assert len(ours[task]) == len(theirs[task]) > 0
    for mine, hf in zip(ours[task], theirs[task]):
      for (a, *greedy_a), (b, *greedy_b) in zip(_flat(mine["resps"]), _flat(hf["resps"])):
        # A rolling item sums hundreds of tokens, which the HF model adds up in float32.
        assert a == pytest.approx(b, abs=1e-4, rel=1e-7 if task == "local_rolling" else 0), (task, mine["doc_id"])
        assert greedy_a == greedy_b
        compared += 1
  assert compared == sum(len(row["choices"]) for row in MC) + len(ours["local_rolling"])
  texts = [s["resps"][0][0] for s in ours["local_gen"]]
  assert texts == [s["resps"][0][0] for s in theirs["local_gen"]]
  assert any(t.strip() for t in texts), texts  # it generated something, identically


def _flat(resps):
  """lm-eval's per-item responses as (log-likelihood, greedy...) tuples."""
  out = []
  for resp in resps:
    value = resp[0]
    out.append(tuple(value) if isinstance(value, (list, tuple)) else (value,))
  return out
