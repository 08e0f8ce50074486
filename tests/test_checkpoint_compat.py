"""A checkpoint written before the registry and the open train state still restores, and
resumes with the loss the old code computed (tests/fixtures/checkpoint_v1/README.md)."""

import shutil
from pathlib import Path

import jax
import numpy as np

from jaxpar.checkpoint import Checkpointer
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1"
MODEL = dict(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, vocab_size=260)
OLD_STEP_3_LOSS = 5.875391006469727  # resuming this checkpoint with the code that wrote it


def test_pre_registry_checkpoint_restores_and_resumes(tmp_path):
  shutil.copytree(FIXTURE / "checkpoints", tmp_path / "run" / "checkpoints")
  config = small_config(model=MODEL, mesh={"fsdp": 1}, data={"seq_len": 16, "global_batch_size": 4},
                        train={"steps": 3}, tmp_path=tmp_path, checkpoint={"async_save": False})
  trainer = Trainer(config, devices=jax.devices()[:1])
  with Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as checkpoints:
    items, data_state = checkpoints.restore(trainer.abstract_state().items())
  assert int(items["step"]) == 2 and data_state == {"next_sample": 8}
  expected = np.load(FIXTURE / "params.npz")
  restored = jax.tree_util.tree_leaves_with_path(jax.device_get(items["params"]))
  assert sorted(expected.files) == sorted(jax.tree_util.keystr(p) for p, _ in restored)
  for path, leaf in restored:
    np.testing.assert_array_equal(leaf, expected[jax.tree_util.keystr(path)])
  result = trainer.fit(show_progress=False)
  assert [h["step"] for h in result.history] == [3]
  np.testing.assert_allclose(result.history[0]["loss"], OLD_STEP_3_LOSS, rtol=1e-6)
