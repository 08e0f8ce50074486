"""Optimizers and schedules: each optimizer trains the same on fsdp4 x tensor2 as on one
device, keeps its state sharded like the parameters, and resumes bit-exactly; schedules
have the shapes they promise; unknown names are one-line errors that list the choices."""

import jax
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.train.optim import learning_rate_schedule
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config

# embed and mlp of 128: Adafactor factors matrices from 128 rows and columns.
MODEL = dict(embed_dim=128, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=128)
STEPS = 4


def _config(tmp_path, optimizer, mesh, **train):
  optimizer, _, state_dtype = optimizer.partition("-")  # e.g. adamw-int8_blockwise
  train = {"optimizer_state_dtype": state_dtype or "float32", **train}
  if optimizer == "galore":  # a rank under the matrices' sides, refreshed before a save and after
    train["galore"] = {"rank": 16, "update_every": 3}
  return small_config(mesh=mesh, model=MODEL, data={"seq_len": 16},
                      train={"steps": STEPS, "optimizer": optimizer, "learning_rate": 1e-3,
                             "warmup_steps": 1, "peak_flops_per_device": 1e9, **train},
                      tmp_path=tmp_path, checkpoint={"every_steps": 2, "keep_last": None, "async_save": False})


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "lion", "sgd", "muon", "galore", "adamw-int8_blockwise"])
def test_optimizer_sharded_equals_one_device_and_resumes_exactly(optimizer, tmp_path):
  sharded = Trainer(_config(tmp_path / "8", optimizer, {"fsdp": 4, "tensor": 2}))
  single = Trainer(_config(tmp_path / "1", optimizer, {"fsdp": 1}, run_dir=str(tmp_path / "1")),
                   devices=jax.devices()[:1])
  start = sharded.init_state()  # one initialisation (a compile) for both meshes
  start_single = jax.device_put(jax.device_get(start), single.state_shardings)
  initial = _leaves(start.params)
  straight = sharded.fit(start, show_progress=False)
  losses = [h["loss"] for h in straight.history]
  assert not all(np.array_equal(a, b) for a, b in zip(initial, _leaves(straight.state.params)))

  # The state mirrors the parameters' layout: each device holds a fraction of it.
  state = straight.state
  for leaf, spec in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(sharded.state_shardings.opt_state)):
    assert leaf.sharding.is_equivalent_to(spec, leaf.ndim)
  total = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
  on_one = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.opt_state))
  assert on_one < total / 4, (on_one, total)

  resumed = sharded.fit(restore=tmp_path / "8" / "run" / "checkpoints" / "2", show_progress=False)
  assert [h["loss"] for h in resumed.history] == losses[2:]
  for a, b in zip(_leaves(resumed.state.items()), _leaves(state.items())):
    np.testing.assert_array_equal(a, b)

  # Lion steps by each gradient's sign: an element whose gradient sums to about zero can take
  # the other sign under the other mesh's summation order, a whole learning-rate step apart
  # (2.7e-5 by the 4th step on an AMD EPYC host; 2e-5 held on the hosts before).
  np.testing.assert_allclose([h["loss"] for h in single.fit(start_single, show_progress=False).history],
                             losses, rtol=1e-4 if optimizer == "lion" else 2e-5)
  if optimizer in ("adamw-int8_blockwise", "galore"):  # 8-bit moments, GaLore's projections: saved on
    # fsdp4 x tensor2, they go on on one device
    moved = single.fit(restore=tmp_path / "8" / "run" / "checkpoints" / "2", show_progress=False)
    np.testing.assert_allclose([h["loss"] for h in moved.history], losses[2:], rtol=2e-5)


def test_optimizer_state_bytes_per_parameter(tmp_path):
  names = ("adamw", "adafactor", "lion", "sgd", "muon", "adamw-bfloat16", "adamw-int8_blockwise",
           "lion-int8_blockwise")
  per_param = {name: Trainer(_config(tmp_path, name, {"fsdp": 1}), devices=jax.devices()[:1])
               .optimizer_bytes_per_param for name in names}
  # Two float32 moments, one, factored rows and columns; Muon: one for matrices, two for the rest.
  assert per_param["adamw"] == pytest.approx(8, abs=0.01)
  assert per_param["lion"] == pytest.approx(4, abs=0.01) and per_param["sgd"] == pytest.approx(4, abs=0.01)
  assert per_param["adafactor"] < 2
  assert 4 < per_param["muon"] < 8
  # Narrower moments (train.optimizer_state_dtype): bf16 halves them; 8-bit codes plus one f32
  # scale per 128 values (per row where 128 does not divide the last axis: 16-wide head_dim rows).
  assert per_param["adamw-bfloat16"] == pytest.approx(4, abs=0.01)
  assert 2 < per_param["adamw-int8_blockwise"] < 2.5 and 1 < per_param["lion-int8_blockwise"] < 1.25


def _values(schedule, steps):
  return np.array([float(schedule(s)) for s in steps])


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_schedules_warm_up_then_follow_their_shape(name):
  train = small_config(train={"schedule": name, "steps": 100, "warmup_steps": 10, "learning_rate": 1.0,
                              "min_lr_ratio": 0.1, "decay_fraction": 0.2}).train
  lr = _values(learning_rate_schedule(train), range(101))
  np.testing.assert_allclose(lr[:11], np.arange(11) / 10, atol=1e-6)  # linear warm-up to the peak
  if name == "constant":
    np.testing.assert_allclose(lr[10:], 1.0)
  elif name == "wsd":
    np.testing.assert_allclose(lr[10:81], 1.0)  # stable until the last 20% of the steps
    np.testing.assert_allclose(lr[80:], np.linspace(1.0, 0.1, 21), atol=1e-6)
  elif name == "linear":
    np.testing.assert_allclose(lr[10:], np.linspace(1.0, 0.1, 91), atol=1e-6)
  else:
    assert lr[55] == pytest.approx(0.55, abs=1e-6) and lr[100] == pytest.approx(0.1)
    assert np.all(np.diff(lr[10:]) < 0)


def test_unknown_optimizer_or_schedule_lists_the_choices():
  with pytest.raises(ConfigError) as error:
    small_config(train={"optimizer": "adam"})
  assert str(error.value) == ("train.optimizer='adam': Input should be 'adamw', 'adafactor', 'lion', "
                              "'sgd', 'muon' or 'galore'")
  with pytest.raises(ConfigError, match="train.schedule='step': Input should be 'cosine', 'linear', "
                                        "'constant' or 'wsd'"):
    small_config(train={"schedule": "step"})
