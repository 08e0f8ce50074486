"""Mixtures and held-out documents: proportions follow the weights, weight 0 is never trained
on, held-out documents never reach training, and a resumed run continues the exact sequence,
also on two processes."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpar.config import DataConfig, from_dict
from jaxpar.data import TrainBatches, load_tokenizer, pack_documents
from jaxpar.errors import ConfigError

BYTE = load_tokenizer("byte")
ROOT = Path(__file__).parent.parent


def _source(tmp_path, name, count, tag):
  """`count` documents, each naming itself: `<tag>:<i>|` repeated."""
  path = tmp_path / f"{name}.jsonl"
  path.write_text("".join(json.dumps({"text": f"<{tag}:{i}|" * (3 + i % 4)}) + "\n" for i in range(count)))
  return str(path)


def _mixture(tmp_path, **extra):
  sources = {"web": {"path": _source(tmp_path, "web", 300, "W"), "weight": 0.6},
             "books": {"path": _source(tmp_path, "books", 200, "B"), "weight": 0.3},
             "code": {"path": _source(tmp_path, "code", 100, "C"), "weight": 0.1},
             "eval": {"path": _source(tmp_path, "eval", 50, "E"), "weight": 0}}
  return DataConfig(sources=sources, seq_len=32, global_batch_size=8, shuffle_seed=3, **extra)


def _take(batches, n):
  return [{k: np.asarray(v) for k, v in next(batches).items()} for _ in range(n)]


def _tags(batch) -> list[str]:
  return [BYTE.decode(row) for row in batch["inputs"]]


def test_mixture_proportions_follow_the_weights_and_weight_0_is_never_trained(tmp_path):
  batches = TrainBatches(_mixture(tmp_path), BYTE)
  text = "".join(t for b in _take(batches, 125) for t in _tags(b))  # 1000 samples
  seen = batches.proportions()
  assert set(seen) == {"web", "books", "code"}
  for name, weight in {"web": 0.6, "books": 0.3, "code": 0.1}.items():
    assert seen[name] == pytest.approx(weight, abs=0.01)
  # What was counted is what was read: each window names its source.
  assert text.count("<W") > text.count("<B") > text.count("<C") > 0 and "<E" not in text


def test_mixture_resumes_mid_epoch_with_the_exact_sequence(tmp_path):
  straight = TrainBatches(_mixture(tmp_path), BYTE)
  _take(straight, 7)
  state = json.loads(json.dumps(straight.get_state()))  # as a checkpoint stores it
  want, proportions = _take(straight, 3), straight.proportions()
  resumed = TrainBatches(_mixture(tmp_path), BYTE)
  resumed.set_state(state)
  got = _take(resumed, 3)
  assert all(np.array_equal(g[k], w[k]) for g, w in zip(got, want) for k in w)
  assert resumed.proportions() == proportions


@pytest.mark.parametrize("seed", range(5))
def test_held_out_documents_never_reach_training(seed, tmp_path):
  rng = np.random.default_rng(seed)
  count, fraction = int(rng.integers(20, 200)), float(rng.uniform(0.05, 0.5))
  docs = [f"<{i}|" * int(rng.integers(1, 30)) for i in range(count)]
  train, heldout = pack_documents(docs, BYTE).split(fraction, seed)
  assert heldout.num_documents > 0 and train.num_documents + heldout.num_documents == count
  held = set(heldout.documents.tolist())
  assert not held & set(train.documents.tolist())
  # Every token a training window holds comes from a document that was not held out.
  read = np.concatenate([train.window(i, 16)["inputs"] for i in range(train.num_windows(16))])
  seen = set(BYTE.decode(read).split("|")[:-1])  # the tail may stop inside a document's name
  assert seen and seen <= {f"<{i}" for i in range(count)} and not {f"<{i}" for i in held} & seen
  held_text = BYTE.decode(heldout.span(0, heldout.num_tokens)[0])
  assert {int(t[1:]) for t in held_text.split("|")[:-1]} == held


def test_training_excludes_the_holdout_the_same_way_every_time(tmp_path):
  path = _source(tmp_path, "one", 200, "D")
  config = DataConfig(source=path, holdout=0.1, seq_len=32, global_batch_size=8)
  a, b = TrainBatches(config, BYTE), TrainBatches(config, BYTE)
  np.testing.assert_array_equal(a.stream.documents, b.stream.documents)
  held = set(a.sources["heldout"].heldout.documents.tolist())
  assert 5 < len(held) < 40 and not held & set(a.stream.documents.tolist())


def test_mixture_config_errors_are_one_line(tmp_path):
  path = _source(tmp_path, "x", 10, "X")
  cases = [({"sources": {"a": {"path": path, "weight": 0}}}, "every weight is 0"),
           ({"source": path, "sources": {"a": {"path": path}}}, "replaces data.source"),
           ({"sources": {"a": {"path": str(tmp_path / "missing.parquet")}}}, "data.sources.a.path="),
           ({"sources": {"a": {"path": path, "weight": -1}}}, "data.sources.a.weight=-1")]
  for data, message in cases:
    with pytest.raises(ConfigError, match=message) as error:
      from_dict({"data": data})
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_two_processes_continue_where_one_left_off(tmp_path):
  """A single process reads 3 batches and saves its position; two processes (gloo, 4 devices
  each, one 8-device mesh) resume from it: together they read exactly what one would next."""
  import subprocess
  config = _mixture(tmp_path)
  single = TrainBatches(config, BYTE)
  _take(single, 3)
  state = single.get_state()
  want = _take(single, 2)
  out = tmp_path / "seen.npz"
  command = [sys.executable, "-m", "jaxpar", "launch-local", "2", "--", sys.executable,
             str(ROOT / "tests" / "multiprocess_data_worker.py"), json.dumps(config.model_dump(mode="json")),
             json.dumps(state), str(out)]
  result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  seen = np.load(out)
  for step, batch in enumerate(want):
    for key, value in batch.items():
      np.testing.assert_array_equal(seen[f"{step}.{key}"], value, err_msg=key)
  assert json.loads(str(seen["state"])) == {**state, "next_sample": state["next_sample"] + 16,
                                             "source_samples": single.get_state()["source_samples"]}
