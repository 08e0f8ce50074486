"""Checkpoints of pipelined runs: a circular stage=4 run stores its layers stage-major, yet
its checkpoint opens with stage=2, stage=1 and without a pipeline (and the other way round)
holding identical values, training continues with equal losses, and its HF export is the
canonical model that `transformers` runs."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.models.pipeline import reorder_layers
from jaxpar.weights import open_run
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config

MODEL = dict(embed_dim=32, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32)
CIRCULAR4 = ({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 2, "microbatches": 4})


def _config(tmp_path, name, mesh, pipeline=None):
  return small_config(mesh=mesh, model=MODEL, data={"seq_len": 16, "global_batch_size": 16},
                      parallel={"pipeline": pipeline or {}}, tmp_path=tmp_path,
                      train={"steps": 4, "run_dir": str(tmp_path / name)})


def _canonical(tree, order):
  return jax.tree.map(np.asarray, reorder_layers(jax.device_get(tree), "layers", order, None))


def _losses(result):
  return [h["loss"] for h in result.history]


def _assert_equal(actual, expected, rtol=0.0):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def circular_run(tmp_path_factory):
  """Two steps on stage=4 x fsdp=2, circular with 2 repeats (optimizer moments not zero),
  saved: (trainer, its step-2 directory, the saved items in canonical layer order)."""
  tmp_path = tmp_path_factory.mktemp("circular")
  trainer = Trainer(_config(tmp_path, "circular", *CIRCULAR4))
  assert trainer.runtime.layer_order() is not None  # stage-major: not the canonical order
  state = trainer.fit(steps=2, show_progress=False).state
  return trainer, tmp_path / "circular" / "checkpoints" / "2", _canonical(state.items(), trainer.runtime.layer_order())


@pytest.mark.parametrize("mesh", [None, {"stage": 2, "fsdp": 4}, {"fsdp": 1}])
def test_a_circular_stage4_checkpoint_opens_on_other_stage_counts(circular_run, mesh):
  _, step_dir, saved = circular_run
  run = open_run(step_dir, mesh, devices=jax.devices()[:1] if mesh == {"fsdp": 1} else None)
  assert run.runtime.plan.stages == (mesh or {}).get("stage", 1)
  _assert_equal(_canonical((run.params, run.model_state), run.runtime.layer_order()),
                (saved["params"], saved["model_state"]))


def test_training_continues_with_equal_losses_across_layouts(circular_run, tmp_path):
  circular, step_dir, saved = circular_run
  flat = Trainer(_config(tmp_path, "flat", {"fsdp": 8}))
  # stage=4 circular -> unpipelined: the same next step as the run that wrote it.
  on_flat = flat.fit(restore=step_dir, steps=1, show_progress=False)
  on_circular = circular.fit(restore=step_dir, steps=1, show_progress=False)
  assert _losses(on_flat) == pytest.approx(_losses(on_circular), rel=1e-5)
  _assert_equal(_canonical(on_flat.state.items(), None),
                _canonical(on_circular.state.items(), circular.runtime.layer_order()), rtol=1e-5)
  # ... and back: the unpipelined step-3 checkpoint restores onto stage=4 exactly, and both go on equally.
  batches = circular.batches()  # the restore sets its position: the next step reads what flat's does
  back = circular.fit(restore=Path(on_flat.summary["checkpoint"]), batches=batches, steps=0, show_progress=False)
  _assert_equal(_canonical(back.state.items(), circular.runtime.layer_order()),
                _canonical(on_flat.state.items(), None))
  assert _losses(circular.fit(state=back.state, batches=batches, steps=1, show_progress=False)) == \
      pytest.approx(_losses(flat.fit(steps=1, show_progress=False)), rel=1e-5)


def test_hf_export_of_a_pipelined_run_is_the_canonical_model(circular_run, tmp_path):
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  from jaxpar.convert.hf import jaxpar_to_hf
  trainer, step_dir, saved = circular_run
  hf = transformers.AutoModelForCausalLM.from_pretrained(jaxpar_to_hf(step_dir, tmp_path / "hf")).eval()
  tokens = np.random.default_rng(0).integers(0, 258, (2, 16))
  with torch.no_grad():
    theirs = hf(torch.tensor(tokens)).logits.numpy()
  ours = trainer.runtime.merge(saved["params"], saved["model_state"])  # canonical order, no pipeline
  np.testing.assert_allclose(theirs, np.asarray(ours(jnp.asarray(tokens))[0]), rtol=1e-4, atol=1e-4)
