"""The one door: implementation choice, shard_map over the mesh, clear errors, and a
model that trains the same with the flash kernel (interpret mode) as with the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels import AttentionSpec
from tests.test_attention import make_inputs

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


def test_auto_picks_cheap_cpu_path_and_kernels_on_accelerators():
  choose = pallas_kernels.choose_implementation
  assert choose("auto", "cpu", 64, 512) == "reference"
  assert choose("auto", "cpu", 64, 32768) == "chunked"
  assert choose("auto", "tpu", 128, 512) == "flash"
  assert choose("auto", "gpu", 80, 512) == "chunked"  # head_dim the kernels do not take
  # 512-wide heads (Gemma 4's global layers): the TPU kernel, except on v4 (16 MiB of VMEM).
  assert choose("auto", "tpu", 512, 512, device_kind="TPU v5p") == "flash"
  assert choose("auto", "tpu", 512, 512, device_kind="TPU v4") == "chunked"
  assert choose("auto", "gpu", 512, 512) == "chunked"
  assert choose("chunked", "tpu", 128, 512) == "chunked"


@pytest.mark.parametrize("implementation", ["flash", "chunked", "auto"])
def test_sharded_dispatch_matches_reference(implementation):
  n = len(jax.devices())
  sizes = (2, 1, 2, 1, 1, 2) if n == 8 else (1,) * 6
  mesh = jax.make_mesh(sizes, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 6)
  q, k, v, _, seg = make_inputs(batch=4, q_len=256, num_heads=4, num_kv_heads=2, segments=True)

  def loss(impl):
    f = lambda q, k, v: jnp.sum(jnp.sin(pallas_kernels.attention(
        q, k, v, AttentionSpec(implementation=impl), segment_ids=seg)))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

  with jax.set_mesh(mesh):
    got = loss(implementation)(q, k, v)
    jaxpr = str(jax.make_jaxpr(loss(implementation))(q, k, v))
  want = loss("reference")(q, k, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
  assert ("shard_map" in jaxpr) == (implementation == "flash" and n > 1)


def test_bad_arguments_name_the_argument():
  q, k, v, _, seg = make_inputs(q_len=128, num_heads=4, num_kv_heads=2)
  flash = lambda q, k, v, block_sizes=None, **kw: pallas_kernels.attention(  # noqa: E731
      q, k, v, AttentionSpec(implementation="flash", block_sizes=block_sizes), **kw)
  with pytest.raises(ValueError, match="head_dim=48"):
    flash(q[..., :48], k[..., :48], v[..., :48])
  with pytest.raises(ValueError, match=r"q heads \(3\).*k/v heads \(2\)"):
    flash(q[:, :, :3], k, v)
  with pytest.raises(ValueError, match="block_q=100"):
    flash(q, k, v, block_sizes=pallas_kernels.BlockSizes(100, 128))
  with pytest.raises(ValueError, match="segment_ids"):
    flash(q, k, v, segment_ids=jnp.zeros((1, 64), jnp.int32))
  with pytest.raises(ValueError, match="implementation='fast'"):
    pallas_kernels.attention(q, k, v, AttentionSpec(implementation="fast"))


def _train_losses(attention, steps=2):
  from jaxpar.train.trainer import Trainer
  from tests.helpers import small_config, synthetic_batch
  config = small_config(model={"attention": attention, "head_dim": 64},
                        mesh={"fsdp": 2, "tensor": 2} if len(jax.devices()) == 8 else {"fsdp": 1})
  trainer = Trainer(config, devices=jax.devices()[:4 if len(jax.devices()) == 8 else 1])
  batch = {key: jax.device_put(value, trainer.batch_sharding)
           for key, value in synthetic_batch(config).items()}
  state, losses = trainer.init_state(), []
  for _ in range(steps):
    state, metrics = trainer.step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses


@pytest.mark.slow
def test_model_trains_with_flash_like_reference():
  np.testing.assert_allclose(_train_losses("flash"), _train_losses("reference"), rtol=1e-5)
