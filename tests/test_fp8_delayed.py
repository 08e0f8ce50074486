"""fp8 with delayed scaling (model.train_precision=fp8_delayed): the door equals the scheme's
jnp definition with the history it is given, the forward and the train step roll each
projection's history with the maxima they saw, the histories are saved and a resume
continues bit for bit, and the blocks without histories are refused in one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import low_precision_delayed as delayed
from jaxpar.models.low_precision import low_precision_matmul
from jaxpar.models.low_precision_reference import reference_delayed_matmul
from jaxpar.train import amax_histories
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config

KEYS = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(KEYS[0], (64, 96))
W = jax.random.normal(KEYS[1], (96, 48)) * 0.05
G = jax.random.normal(KEYS[2], (64, 48))
# Rows of past maxima: x's below its own (so its largest values saturate), w's above its own
# (a coarser grid), the gradient's a little above.
PAST = jnp.stack([jnp.array([1.5, 0.5, 0.0, 2.0]), jnp.array([0.0, 0.4, 0.1, 0.0]),
                  jnp.array([5.0, 0.0, 0.0, 0.0])])


@pytest.mark.parametrize("past", [PAST, jnp.zeros((3, 4))], ids=["history", "empty"])
def test_door_equals_the_definition_and_rolls_the_history(past):
  """y and dx equal the definition bitwise (dw to f32 rounding) with the scales the history gives (an empty
  history: each tensor's own maximum); the forward returns the input's and weight's rows
  rolled with their maxima, and the backward returns the gradient's maximum as the history's
  cotangent at [2, 0]."""
  def door(x, w, history):
    variable = delayed.AmaxHistory(history)
    y = low_precision_matmul(x, w, "fp8_delayed", variable)
    return y, variable[...]

  (y, after), back = jax.vjp(door, X, W, past)
  dx, dw, maxima = back((G, jnp.zeros_like(after)))
  want, want_back = jax.vjp(lambda x, w: reference_delayed_matmul(x, w, past), X, W)
  want_dx, want_dw = want_back(G)
  for name, a, b in (("y", y, want), ("dx", dx, want_dx)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  # dw contracts the tokens: the CPU dot sums [K, M] @ [M, N] and the door's contraction over
  # both operands' first axis in other orders (4 of 4,608 entries an f32 ulp apart).
  assert float(jnp.abs(dw - want_dw).max()) <= 1e-6 * float(jnp.abs(want_dw).max())
  if not past.any():  # scaled by their own maxima: fp8's error
    assert float(jnp.abs(y - X @ W).max()) < 0.1 * float(jnp.abs(X @ W).max())
  np.testing.assert_array_equal(after[0], jnp.concatenate([jnp.max(jnp.abs(X))[None], past[0, :-1]]))
  np.testing.assert_array_equal(after[1], jnp.concatenate([jnp.max(jnp.abs(W))[None], past[1, :-1]]))
  np.testing.assert_array_equal(after[2], past[2])  # the train step writes this row
  np.testing.assert_array_equal(maxima, jnp.zeros((3, 4)).at[2, 0].set(jnp.max(jnp.abs(G))))
  if past.any():  # x's history lies below its maximum: its largest entries saturated
    assert float(jnp.max(jnp.abs(X))) > 1.5 and not np.array_equal(
        np.asarray(y), np.asarray(reference_delayed_matmul(X, W, past.at[0].set(0.0))))


def _config(tmp_path, steps=4, precision="fp8_delayed", **train):
  model = dict(embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
               train_precision=precision, fp8_amax_history=3)
  return small_config(model=model, mesh={"fsdp": 4, "tensor": 2}, data={"seq_len": 16},
                      train={"steps": steps, "learning_rate": 1e-3, "warmup_steps": 1, **train}, tmp_path=tmp_path,
                      checkpoint={"every_steps": 2, "keep_last": None, "async_save": False})


def _histories(state):
  histories, _ = amax_histories.split_histories(jax.device_get(state.model_state))
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(histories)}


def test_train_steps_fill_the_histories_and_a_resume_continues_bit_for_bit(tmp_path):
  """Every projection of both stacked layers (q, k, v, o; gate, up, down) has a history of
  3 per layer; after one step each has the input's, weight's and gradient's maxima in front
  and zeros behind; each later step pushes them back one place. The loss stays beside the
  float run's; a resume from step 2's checkpoint gives the same losses and histories."""
  trainer = Trainer(_config(tmp_path))
  first = trainer.fit(show_progress=False)  # each run from its own init: the same weights (one seed)
  final = _histories(first.state)
  assert len(final) == 7 and all(h.shape == (2, 3, 3) for h in final.values()), {k: v.shape for k, v in final.items()}
  assert all((h[..., 0] > 0).all() and (h[..., 2] > 0).all() for h in final.values())  # 4 steps: full rows

  one = Trainer(_config(tmp_path / "one", steps=1)).fit(show_progress=False)
  after_one = _histories(one.state)
  for name, h in after_one.items():
    assert (h[..., 0] > 0).all() and not h[..., 1:].any(), name
  two = Trainer(_config(tmp_path / "two", steps=2)).fit(show_progress=False)
  for name, h in _histories(two.state).items():
    np.testing.assert_array_equal(h[..., 1], after_one[name][..., 0], err_msg=name)

  float_run = Trainer(_config(tmp_path / "float", precision="compute_dtype")).fit(show_progress=False)
  float_losses = [h["loss"] for h in float_run.history]
  losses = [h["loss"] for h in first.history]
  np.testing.assert_allclose(losses, float_losses, rtol=0.02)

  resumed = trainer.fit(restore=tmp_path / "run" / "checkpoints" / "2", show_progress=False)
  assert [h["loss"] for h in resumed.history] == losses[2:]
  for name, h in _histories(resumed.state).items():
    np.testing.assert_array_equal(h, final[name], err_msg=name)


@pytest.mark.parametrize("config, overrides, named", [
    ("tiny-moe", [], "model.mlp=moe"), ("tiny", ["model.mlp_chunks=2"], "model.mlp_chunks=2"),
    ("tiny-qwen3.5", [], "model.layer_pattern mixer=gated_deltanet"), ("tiny-gemma4", [], "model.attention_block=gemma4"),
])
def test_blocks_without_histories_are_refused_in_one_line(config, overrides, named):
  from jaxpar.config import load_config
  from jaxpar.errors import ConfigError
  with pytest.raises(ConfigError, match=f"keeps scaling histories for the attention and dense MLP projections "
                                        f"only, not {named}: train with model.train_precision=fp8") as error:
    load_config(config, ["model.train_precision=fp8_delayed", *overrides])
  assert "\n" not in str(error.value)


def test_a_projection_without_a_history_is_a_one_line_error():
  from jaxpar.errors import ConfigError
  with pytest.raises(ConfigError, match="needs a scaling history this projection does not keep"):
    low_precision_matmul(X, W, "fp8_delayed")
  assert delayed.amax_history("fp8", 4) is None
  assert isinstance(delayed.amax_history("fp8_delayed", 4), nnx.Variable)
