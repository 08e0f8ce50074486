"""The runtime every entry point shares: mesh, rules, abstract model, shardings, init, restore.

The trainer, the inference engine, Hugging Face conversion and AOT compilation all start
from a `Runtime` instead of rebuilding these by hand. Model variables split in two:
`params` (nnx.Param: what the optimizer updates) and `model_state` (every other variable:
router biases, running statistics), each a plain nested dict of arrays, which optax, Orbax
and jit shardings handle directly.
"""

import contextlib

import jax
from flax import nnx

from jaxpar.checkpoint import Checkpointer, resolve
from jaxpar.mesh import build_mesh, resolve_rules, state_shardings
from jaxpar.mesh.rules import sequence_parallel_rules, unused_mesh_axes
from jaxpar.models import build_model, get_family


def _split(model):
  """(graphdef, params State, model_state State) of a module."""
  return nnx.split(model, nnx.Param, ...)


def abstract_model(model_cfg, seed: int = 0):
  """(graphdef, abstract params State, abstract model_state State), allocating nothing."""
  return _split(nnx.eval_shape(lambda: build_model(model_cfg, nnx.Rngs(seed))))


def count_params(abstract_params) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(abstract_params)))


def weight_decay_mask(abstract_params) -> dict:
  """True for every parameter that does not declare `weight_decay=False` (norm scales)."""
  return nnx.to_pure_dict(jax.tree.map(lambda v: v.get_metadata().get("weight_decay", True),
                                       abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def with_shardings(abstract: dict, shardings: dict) -> dict:
  """ShapeDtypeStructs carrying shardings: targets for restores and AOT compiles."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


class Runtime:
  """A model config on a device mesh.

  mesh, rules: the named mesh and the logical-axis rules (the config's, else the family's
  preset); graphdef + abstract_params / abstract_model_state: the model without memory;
  param_shardings / model_state_shardings: NamedShardings read from the axis names.
  """

  def __init__(self, model_cfg, mesh_cfg, devices=None, *, seed: int = 0):
    self.model_config = model_cfg
    self.family = get_family(model_cfg.family)
    self.mesh = build_mesh(mesh_cfg, devices)
    self.rules = resolve_rules(mesh_cfg.rules or self.family.rules)
    if model_cfg.sequence_parallel:
      self.rules = sequence_parallel_rules(self.rules)
    unused = unused_mesh_axes(self.rules, dict(self.mesh.shape))
    if unused:
      raise ValueError(f"mesh.{unused[0]}={self.mesh.shape[unused[0]]} but mesh.rules="
                       f"{mesh_cfg.rules!r} never uses that axis: pick rules that do "
                       "(e.g. fsdp_tp) or set it to 1")
    self.seed = seed
    self.graphdef, abstract_params, abstract_model_state = abstract_model(model_cfg, seed)
    self.num_params = count_params(abstract_params)
    self.decay_mask = weight_decay_mask(abstract_params)
    self.abstract_params = nnx.to_pure_dict(abstract_params)
    self.abstract_model_state = nnx.to_pure_dict(abstract_model_state)
    self.param_shardings = nnx.to_pure_dict(state_shardings(abstract_params, self.mesh, self.rules))
    self.model_state_shardings = nnx.to_pure_dict(
        state_shardings(abstract_model_state, self.mesh, self.rules))

  @contextlib.contextmanager
  def context(self):
    """The mesh and logical rules that tracing model code needs."""
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
      yield

  def create(self) -> tuple[dict, dict]:
    """(params, model_state) freshly initialised: the body of `init`, for use inside jit."""
    params, model_state = _split(build_model(self.model_config, nnx.Rngs(self.seed)))[1:]
    return nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)

  def init(self) -> tuple[dict, dict]:
    """(params, model_state) initialised inside jit with out_shardings: each device creates
    only its own shard, so a 70B model never materialises on one device."""
    with self.context():
      return jax.jit(self.create, out_shardings=(self.param_shardings, self.model_state_shardings))()

  def abstract_targets(self) -> tuple[dict, dict]:
    """(params, model_state) as sharded ShapeDtypeStructs."""
    return (with_shardings(self.abstract_params, self.param_shardings),
            with_shardings(self.abstract_model_state, self.model_state_shardings))

  def merge(self, params, model_state=None):
    """The module with these arrays (inside jit: rebuilds it for tracing)."""
    return nnx.merge(self.graphdef, params, model_state or {})

  def restore(self, path, step: int | None = None) -> tuple[dict, dict]:
    """(params, model_state) from a checkpoint (a checkpoint dir: its latest step; or one
    step dir), read straight into this mesh's shardings: each device reads only its shard."""
    root, found_step = resolve(path)
    step = step if step is not None else found_step
    params, model_state = self.abstract_targets()
    with Checkpointer(root, read_only=True) as checkpoints:
      return (checkpoints.restore_item("params", params, step),
              checkpoints.restore_item("model_state", model_state, step))
