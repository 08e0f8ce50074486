"""The saved-run door: a run dir, its checkpoints/ dir and one step dir open the same run,
once; the weights land on the mesh asked for and equal what training ended with; the
engine, `--restore` and a copy on another machine (data paths gone) go through it."""

import json
import shutil

import jax
import numpy as np
import pytest

import jaxpar
from jaxpar.errors import CheckpointError
from jaxpar.inference import Engine
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 2-step run of the small model on one device, with its checkpoint."""
  tmp_path = tmp_path_factory.mktemp("saved_run")
  config = small_config(mesh={"fsdp": 1}, tmp_path=tmp_path, train={"steps": 2})
  result = Trainer(config, devices=jax.devices()[:1]).fit(show_progress=False)
  return config, result, tmp_path / "run"


def test_run_dir_checkpoint_dir_and_step_dir_open_the_same_run(trained):
  config, result, run_dir = trained
  for path in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "2"):
    with jaxpar.SavedRun(path) as run:
      assert run.step == 2 and run.directory == run_dir / "checkpoints"
      assert run.config.model == config.model and run.has_optimizer_state


def test_open_run_restores_the_trained_weights_on_any_mesh(trained):
  config, result, run_dir = trained
  want = jax.device_get(result.state.params)
  for mesh in (None, {"fsdp": 4, "tensor": 2}):
    run = jaxpar.open_run(run_dir, mesh=mesh)
    assert dict(run.runtime.mesh.shape)["tensor"] == (2 if mesh else 1)
    for a, b in zip(jax.tree.leaves(jax.device_get(run.params)), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)
    tokens = np.arange(16, dtype=np.int32)[None]
    with run.runtime.context():
      logits, _ = jax.jit(lambda p, t: run.runtime.merge(p)(t))(run.params, tokens)
    assert logits.shape == (1, 16, config.model.vocab_size)
    run.close()


def test_the_engine_generates_from_a_saved_run(trained):
  _, _, run_dir = trained
  with jaxpar.open_run(run_dir, mesh={"data": -1, "fsdp": 1}) as run:
    engine = Engine.from_run(run, slots=2, page_size=8, prefill_chunks=(8,))
    model = run.model
  completion = engine.generate(["The "], jaxpar.inference.SamplingParams(max_tokens=5, stop_token_ids=()))[0]
  # The saved weights' greedy continuation, recomputed by full forwards of the restored model.
  tokens = engine.encode("The ")
  forward = jax.jit(lambda tokens: model(tokens)[0][0, -1].argmax())
  with run.runtime.context():
    for _ in range(5):
      tokens.append(int(forward(np.asarray([tokens], np.int32))))
  assert completion.tokens == tokens[-5:] and completion.finish_reason == "length"


def test_a_copy_whose_data_paths_are_gone_still_opens(trained, tmp_path):
  _, _, run_dir = trained
  copy = tmp_path / "elsewhere"
  shutil.copytree(run_dir / "checkpoints", copy)
  config_file = copy / "2" / "config" / "metadata"
  saved = json.loads(config_file.read_text())
  saved["data"]["source"] = "/nowhere/corpus.jsonl"
  config_file.write_text(json.dumps(saved))
  run = jaxpar.open_run(copy)
  assert run.config.data.source == "/nowhere/corpus.jsonl" and run.tokenizer.vocab_size > 0
  with pytest.raises(jaxpar.ConfigError, match="data.source='/nowhere/corpus.jsonl' does not exist"):
    jaxpar.load_config(None, ["data.source=/nowhere/corpus.jsonl"])


def test_missing_and_empty_paths_are_one_line_errors(tmp_path):
  with pytest.raises(CheckpointError, match="does not exist: give a run directory"):
    jaxpar.open_run(tmp_path / "nope")
  with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
    jaxpar.open_run(tmp_path)


def test_restore_continues_from_a_saved_run(trained, tmp_path):
  config, result, run_dir = trained
  fresh = small_config(mesh={"fsdp": 2}, tmp_path=tmp_path, train={"steps": 3})
  again = Trainer(fresh, devices=jax.devices()[:2]).fit(show_progress=False, restore=run_dir)
  assert int(again.state.step) == 3 and len(again.history) == 1
