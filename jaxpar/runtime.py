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

from jaxpar.mesh import build_mesh, execution_options, resolve_rules, state_shardings
from jaxpar.models import build_model, get_family
from jaxpar.models.medusa import MedusaParam
from jaxpar.models.pipeline import reorder_layers
from jaxpar.models.transformer import PIPELINED_GROUP
from jaxpar.parallel import ParallelConfig, ParallelPlan


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


def adapter_leaves(abstract_params) -> dict:
  """True for every leaf that trains over a frozen base: the adapters (nnx.LoRAParam,
  models/lora.py) under model.lora, the draft heads (models/medusa.py) under model.medusa."""
  return nnx.to_pure_dict(jax.tree.map(lambda v: isinstance(v, (nnx.LoRAParam, MedusaParam)), abstract_params,
                                       is_leaf=lambda x: isinstance(x, nnx.Variable)))


def logical_axis_names(abstract_params) -> dict:
  """Each parameter's logical axis names, e.g. ("layers", "embed", "mlp")."""
  return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata().get("out_sharding") or ()),
                                       abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def with_shardings(abstract: dict, shardings: dict) -> dict:
  """ShapeDtypeStructs carrying shardings: targets for restores and AOT compiles."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


class Runtime:
  """A model config on a device mesh.

  mesh, rules: the named mesh and the logical-axis rules (the config's, else the family's
  preset, as the plan runs them); plan: what each mesh axis does (jaxpar/parallel.py);
  graphdef + abstract_params / abstract_model_state: the model without memory;
  param_shardings / model_state_shardings: NamedShardings read from the axis names;
  adapter_mask: under model.lora or model.medusa, a params-shaped tree of bools, True for the
  adapters or draft heads (the only weights that train: jaxpar/weights/frozen.py); None when
  the whole model trains.
  """

  @classmethod
  def from_config(cls, config, devices=None) -> "Runtime":
    """The runtime of a whole config (model, mesh, parallel section, seed)."""
    return cls(config.model, config.mesh, devices, seed=config.train.seed, parallel=config.parallel)

  def __init__(self, model_cfg, mesh_cfg, devices=None, *, seed: int = 0,
               parallel: ParallelConfig = ParallelConfig()):
    self.model_config = model_cfg
    self.mesh_config = mesh_cfg
    self.family = get_family(model_cfg.family)
    self.mesh = build_mesh(mesh_cfg, devices)
    self.plan = ParallelPlan.of(self.mesh, parallel)
    self.plan.check(model_cfg)
    self.plan.check_platform(model_cfg, self.mesh.devices.flat[0].platform)
    self.rules = self.plan.rules(resolve_rules(mesh_cfg.rules or self.family.rules))
    self.plan.check_rules(self.rules, mesh_cfg.rules)
    self.seed = seed
    self.graphdef, abstract_params, abstract_model_state = abstract_model(model_cfg, seed)
    self.num_params = count_params(abstract_params)
    self.decay_mask = weight_decay_mask(abstract_params)
    self.axis_names = logical_axis_names(abstract_params)
    self.adapter_mask = adapter_leaves(abstract_params) if model_cfg.frozen_base is not None else None
    self.abstract_params = nnx.to_pure_dict(abstract_params)
    self.abstract_model_state = nnx.to_pure_dict(abstract_model_state)
    self.param_shardings = self._shardings(abstract_params)
    self.model_state_shardings = self._shardings(abstract_model_state)

  def _shardings(self, abstract) -> dict:
    """NamedShardings from the axis names; a pipeline's layer group lies split over `stage`."""
    shardings = nnx.to_pure_dict(state_shardings(abstract, self.mesh, self.rules))
    if self.plan.pipelined and PIPELINED_GROUP in shardings:
      shardings[PIPELINED_GROUP] = nnx.to_pure_dict(state_shardings(
          abstract[PIPELINED_GROUP], self.mesh, self.plan.pipeline_rules(self.rules)))
    return shardings

  def layer_order(self):
    """Stored position -> canonical layer of the pipelined group (None: canonical order)."""
    return self.plan.layer_order(self.model_config)

  @contextlib.contextmanager
  def context(self):
    """The mesh and logical rules that tracing model code needs."""
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules), \
        execution_options(self.plan.execution_options):
      yield

  def create(self) -> tuple[dict, dict]:
    """(params, model_state) freshly initialised: the body of `init`, for use inside jit. The
    same values on every mesh; a circular pipeline stores its layer group stage-major."""
    params, model_state = _split(build_model(self.model_config, nnx.Rngs(self.seed)))[1:]
    trees = nnx.to_pure_dict(params), nnx.to_pure_dict(model_state)
    return tuple(reorder_layers(tree, PIPELINED_GROUP, None, self.layer_order()) for tree in trees)

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

  def restore(self, checkpoints, step: int) -> tuple[dict, dict]:
    """(params, model_state) of `step` of an open Checkpointer, read straight into this mesh's
    shardings: each device reads only its shard, whatever mesh wrote it."""
    params, model_state = self.abstract_targets()
    return (checkpoints.restore_item("params", params, step),
            checkpoints.restore_item("model_state", model_state, step))
