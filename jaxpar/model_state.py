"""Build a model abstractly, read its shardings, and initialise its parameters sharded.

Parameters are a plain nested dict of arrays (`nnx.State.to_pure_dict()`), which optax,
Orbax and jit shardings all handle directly; `nnx.merge(graphdef, params)` rebuilds the
module inside a jitted function.
"""

import jax
from flax import nnx

from jaxpar.mesh import state_shardings
from jaxpar.models import Llama


def abstract_model(model_cfg, seed: int = 0):
  """(graphdef, abstract nnx.State with logical names) without allocating anything."""
  model = nnx.eval_shape(lambda: Llama(model_cfg, nnx.Rngs(seed)))
  return nnx.split(model)


def param_shardings(abstract_state, mesh, rules) -> dict:
  return state_shardings(abstract_state, mesh, rules).to_pure_dict()


def init_params(model_cfg, seed: int, shardings: dict) -> dict:
  """Initialise inside jit with out_shardings: each device creates only its own shard."""
  def create():
    return nnx.state(Llama(model_cfg, nnx.Rngs(seed))).to_pure_dict()
  return jax.jit(create, out_shardings=shardings)()


def count_params(abstract_state) -> int:
  return sum(x.size for x in jax.tree.leaves(abstract_state.to_pure_dict()))
