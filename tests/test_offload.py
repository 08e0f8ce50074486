"""`train.offload_optimizer: host`: the optimizer state rests in pinned host memory and the
host runs the update (jaxpar/train/offload.py). It trains as the device-resident optimizer
does, its checkpoints move to and from device runs, the compiled TPU program holds no
moments on the device, and the combinations it cannot serve are one-line errors."""

import jax
import numpy as np
import pytest

from jaxpar.config import load_config
from jaxpar.errors import ConfigError
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config

MODEL = dict(embed_dim=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=128)
MESH = {"fsdp": 4, "tensor": 2}


def _config(tmp_path, optimizer, offload, grad_clip=1.0):
  return small_config(mesh=MESH, model=MODEL, data={"seq_len": 16},
                      train={"steps": 4, "optimizer": optimizer, "learning_rate": 1e-3, "warmup_steps": 1,
                             "grad_clip": grad_clip, "offload_optimizer": offload},
                      tmp_path=tmp_path, checkpoint={"every_steps": 2, "keep_last": None, "async_save": False})


@pytest.mark.parametrize("optimizer, grad_clip", [("adamw", 1.0), ("sgd", None)], ids=["adamw-clipped", "sgd"])
def test_the_host_optimizer_trains_as_on_the_device_and_checkpoints_move_between_them(optimizer, grad_clip,
                                                                                     tmp_path):
  """From the same start on fsdp4 x tensor2: every step's loss and the final parameters and
  moments equal the device optimizer's (the host computes the same f32 update); the state
  stays in pinned host memory; a checkpoint the host run saved continues on the device."""
  device = Trainer(_config(tmp_path / "device", optimizer, "none", grad_clip))
  host = Trainer(_config(tmp_path / "host", optimizer, "host", grad_clip))
  start = jax.device_get(device.init_state())
  on_device = device.fit(jax.device_put(start, device.state_shardings), show_progress=False)
  on_host = host.fit(jax.device_put(start, host.state_shardings), show_progress=False)
  assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(on_host.state.opt_state)} == {"pinned_host"}
  assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(on_host.state.params)} == {"device"}
  losses = [h["loss"] for h in on_device.history]
  np.testing.assert_allclose([h["loss"] for h in on_host.history], losses, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(jax.device_get(on_host.state.items())),
                  jax.tree.leaves(jax.device_get(on_device.state.items()))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  moved = device.fit(restore=tmp_path / "host" / "run" / "checkpoints" / "2", show_progress=False)
  np.testing.assert_allclose([h["loss"] for h in moved.history], losses[2:], rtol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["mesh.data=2", "train.sync=diloco"], "train.sync=diloco keeps a state per replica"),
    (["train.optimizer_state_dtype=int8_blockwise"], "set train.optimizer_state_dtype=float32"),
])
def test_what_the_host_optimizer_cannot_serve_is_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message) as error:
    load_config("tiny", ["train.offload_optimizer=host", *overrides])
  assert "\n" not in str(error.value)


@pytest.mark.tpu
def test_the_compiled_tpu_step_keeps_no_moments_on_the_device():
  """tiny on v5e-4 (libtpu, no chip), offloaded: the step's device arguments hold the
  parameters (and the batch) but not the optimizer state's bytes, which the host holds."""
  from jaxpar.aot.compile import compile_for_topology
  config = load_config("tiny", ["train.offload_optimizer=host", "mesh.fsdp=4", "model.num_layers=1",
                                "checkpoint.enabled=false"])
  report = compile_for_topology(config, "v5e-4")[0]
  state, memory = report["state_bytes"], report["memory"]
  assert state["opt_state_on_host"] and state["opt_state"] > 0
  assert state["params"] <= memory["arguments"] < state["params"] + state["opt_state"]
  assert memory["host_total"] >= state["opt_state"]
