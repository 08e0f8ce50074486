"""GaLore (train.optimizer: galore): the update by hand for a plain and a stacked matrix, the
projection held between refreshes, and optimizer state of the rank formula's size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.train.galore import projected, scale_by_galore
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config

EPS = 1e-8


def _first_direction(g, rank):
  """Adam's first step in the top-`rank` left singular subspace of g ([m, n]), in float64:
  P (m / (sqrt(v) + eps)) with bias-corrected m = R and v = R^2, R = P^T g. Independent of
  the singular vectors' signs."""
  u = np.linalg.svd(g.astype(np.float64), full_matrices=False)[0][:, :rank]
  r = u.T @ g
  return u @ (r / (np.abs(r) + EPS)), u


def test_the_first_updates_by_hand_and_the_projection_held_until_its_refresh():
  rng = np.random.default_rng(0)
  names = {"up": ("embed", "mlp"), "out": ("layers", "heads", "head_dim", "embed"), "scale": ("embed",),
           "table": ("vocab", "embed")}
  params = {"up": jnp.zeros((16, 24)), "out": jnp.zeros((2, 3, 4, 16)), "scale": jnp.zeros((16,)),
            "table": jnp.zeros((8, 16))}
  assert [projected(names[k]) for k in params] == [True, True, False, False]
  optimizer = scale_by_galore(names, rank=4, update_every=2, scale=0.5, b1=0.9, b2=0.95, eps=EPS)
  state = optimizer.init(params)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  update, state = jax.jit(optimizer.update)(grads, state)

  want, basis = _first_direction(np.asarray(grads["up"]), 4)
  np.testing.assert_allclose(update["up"], 0.5 * want, rtol=2e-4, atol=1e-5)
  assert state.mu["up"].shape == (4, 24) and state.projection["up"].shape == (16, 4)
  for layer in range(2):  # each stacked layer's [heads x head_dim, embed] matrix, embed projected
    g = np.asarray(grads["out"][layer]).reshape(12, 16).T  # [embed, heads x head_dim]
    np.testing.assert_allclose(np.asarray(update["out"][layer]).reshape(12, 16).T, 0.5 * _first_direction(g, 4)[0],
                               rtol=2e-4, atol=1e-5)
  assert state.mu["out"].shape == (2, 3, 4, 4) and state.projection["out"].shape == (2, 4, 1, 16)
  for key in ("scale", "table"):  # plain Adam
    g = np.asarray(grads[key])
    np.testing.assert_allclose(update[key], g / (np.abs(g) + EPS), rtol=1e-5)
    assert state.mu[key].shape == params[key].shape

  # Step 2 keeps the projection (update_every=2); step 3 takes one from its own gradient.
  held = np.asarray(state.projection["up"])
  np.testing.assert_allclose(np.abs(held.T @ basis), np.eye(4), atol=1e-4)  # the gradient's top subspace
  other = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  _, state = jax.jit(optimizer.update)(other, state)
  np.testing.assert_array_equal(state.projection["up"], held)
  _, state = jax.jit(optimizer.update)(other, state)
  np.testing.assert_allclose(np.abs(np.asarray(state.projection["up"]).T @ _first_direction(np.asarray(other["up"]), 4)[1]),
                             np.eye(4), atol=1e-4)


def test_galore_state_follows_the_rank_formula(tmp_path):
  model = dict(embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96)
  config = small_config(mesh={"fsdp": 1}, model=model, data={"seq_len": 16},
                        train={"optimizer": "galore", "galore": {"rank": 8}})
  trainer = Trainer(config, devices=jax.devices()[:1])
  floats = 0
  for names, param in zip(jax.tree.leaves(trainer.runtime.axis_names, is_leaf=lambda x: isinstance(x, tuple)),
                          jax.tree.leaves(trainer.runtime.abstract_params)):
    if projected(names):  # P (m x r) and two moments (r x n) per matrix
      layers = param.shape[0] if "layers" in names else 1
      m = param.shape[names.index("embed")]
      n = param.size // layers // m
      floats += layers * (m * 8 + 2 * 8 * n)
    else:
      floats += 2 * param.size
  total = trainer.optimizer_bytes_per_param * trainer.num_params
  assert floats * 4 <= total <= floats * 4 + 16  # and the step counters
  with pytest.raises(Exception, match="galore's keep float32"):
    small_config(train={"optimizer": "galore", "optimizer_state_dtype": "int8_blockwise"})
