"""`train.optimizer_state_dtype`: moments stored in bf16 or 8 bits between steps
(jaxpar/train/moments.py) keep their values where Adam needs them and train like f32 moments.
The sharded, resumed and bytes-per-parameter checks are in test_optim.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpar.train.moments import block_axis, decode_blockwise, encode_blockwise, narrow_moments
from tests.helpers import small_config


def test_second_moments_keep_a_code_across_their_range():
  """Second moments spread over 10 decades in one block: none decodes to zero (Adam divides by
  its square root), and the square root comes back within 1/(255 t) relative, t = (v / block
  max) ** (1/4): 12.5% a million times below the block's largest, 3.4% at 1e-4. A linear 8-bit
  code would store most of them as zero."""
  v = 10.0 ** jax.random.uniform(jax.random.key(0), (4, 256), minval=-10, maxval=0)
  moment = encode_blockwise(v, axis=1, non_negative=True)
  assert moment.codes.dtype == jnp.uint8 and moment.scales.shape == (4, 2)
  back = decode_blockwise(moment)
  assert bool(jnp.all(back > 0))
  relative = jnp.abs(jnp.sqrt(back) - jnp.sqrt(v)) / jnp.sqrt(v)
  below = v / jnp.repeat(moment.scales, 128, axis=-1)
  for fraction, bound in ((1e-6, 0.125), (1e-4, 0.035)):
    assert float(relative[below > fraction].max()) < bound
  linear = jnp.round(255 * below)
  assert float((linear == 0).mean()) > 0.6


def test_first_moments_keep_sign_and_scale():
  """First moments over 3 decades: signs survive, and values above 1% of their block's largest
  come back within 6.3% (the code is 127 sqrt(|m| / max))."""
  m = jax.random.normal(jax.random.key(1), (3, 128)) * 10.0 ** jax.random.uniform(jax.random.key(2), (3, 128), minval=-3)
  moment = encode_blockwise(m, axis=1, non_negative=False)
  back = decode_blockwise(moment)
  assert moment.codes.dtype == jnp.int8
  big = jnp.abs(m) > 0.01 * jnp.abs(m).max(axis=-1, keepdims=True)
  assert bool(jnp.all(jnp.sign(back[big]) == jnp.sign(m[big])))
  assert float((jnp.abs(back - m) / jnp.abs(m))[big].max()) < 0.065


@pytest.mark.parametrize("dtype,margin", [("bfloat16", 0.005), ("int8_blockwise", 0.02)])
def test_adam_with_narrow_moments_fits_like_float_moments(dtype, margin):
  """Noisy least squares [512, 256] @ [256, 128] with AdamW for 200 steps: along the way and
  at the end (near the noise floor) the narrow moments' loss is within `margin` of the f32
  moments'."""
  keys = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(keys[0], (512, 256))
  target = x @ jax.random.normal(keys[1], (256, 128)) + jax.random.normal(keys[3], (512, 128))
  loss = lambda w: jnp.mean((x @ w - target) ** 2)  # noqa: E731
  w0 = jax.random.normal(keys[2], (256, 128)) * 0.01

  def fit(optimizer):
    @jax.jit
    def run(w):
      def step(carry, _):
        w, state = carry
        value, grad = jax.value_and_grad(loss)(w)
        updates, state = optimizer.update(grad, state, w)
        return (optax.apply_updates(w, updates), state), value
      return jax.lax.scan(step, (w, optimizer.init(w)), None, length=200)[1]
    return np.asarray(run(w0))

  adam = optax.adamw(3e-2, b2=0.95, weight_decay=0.0)
  plain, narrow = fit(adam), fit(narrow_moments(adam, dtype, w0, ("embed", "mlp")))
  assert plain[-1] < plain[0] / 50
  for step in (20, 50, 100, 199):
    assert abs(narrow[step] - plain[step]) <= margin * plain[step], (step, narrow[step], plain[step])


def test_blocks_run_along_an_axis_fsdp_does_not_split():
  """Along the last axis that is not `embed` and that 128 divides: down [layers, mlp, embed]
  along mlp, q [embed, heads, head_dim] along head_dim (one block of 96 where 128 does not
  divide it); only `embed` axes: the last."""
  assert block_axis((80, 28672, 8192), ("layers", "mlp", "embed")) == 1
  assert block_axis((80, 8192, 28672), ("layers", "embed", "mlp")) == 2
  assert block_axis((8192, 8, 96), ("embed", "heads", "head_dim")) == 2
  assert block_axis((8192,), ("embed",)) == 0
  moment = encode_blockwise(jnp.ones((4, 256, 8)), axis=1, non_negative=False)
  assert moment.scales.shape == (4, 2, 8) and decode_blockwise(moment).shape == (4, 256, 8)


def test_refused_where_the_optimizer_keeps_its_own_moments():
  with pytest.raises(Exception, match="train.optimizer_state_dtype=int8_blockwise stores AdamW's"):
    small_config(train={"optimizer": "muon", "optimizer_state_dtype": "int8_blockwise"})
