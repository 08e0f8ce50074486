"""The one place logical axis names become PartitionSpecs and NamedShardings."""

import functools
import logging
import math

import jax
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.mesh.rules import resolve_rules
from jaxpar.mesh.shard_map import vmapped_mesh_axes

log = logging.getLogger(__name__)


def logical_to_spec(names, shape, mesh, rules) -> PartitionSpec:
  """Map logical names to mesh axes. A dimension that the mapped mesh axes do not divide
  is replicated (with a warning) rather than left to fail deep inside XLA; a mesh axis
  already used by an earlier dimension is not used again."""
  table = dict(rules)
  used = set()
  spec = []
  for dim, name in enumerate(names):
    axes = tuple(a for a in table.get(name, ()) if a not in used and mesh.shape[a] > 1) if name else ()
    if name is not None and name not in table:
      raise ConfigError(f"logical axis {name!r} has no rule; add it to mesh.rules")
    split = math.prod(mesh.shape[a] for a in axes)
    if axes and shape is not None and shape[dim] % split:
      if shape[dim] > 1:  # one row (a batch of one prompt) has nothing to split: no news
        _warn_once(name, shape[dim], axes, split)
      axes = ()
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else (axes or None))
  return PartitionSpec(*spec)


@functools.lru_cache(maxsize=None)
def _warn_once(name, size, axes, split):
  """A shape traced again (every layer, every compile) warns only the first time."""
  log.warning("replicating logical axis %r (size %d): mesh axes %s (%d devices) do not divide it",
              name, size, axes, split)


def logical_to_sharding(names, shape, mesh, rules) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))


def _names_of(variable):
  names = variable.get_metadata().get("out_sharding")
  return tuple(names) if names else (None,) * len(variable.shape)


def state_shardings(state, mesh, rules):
  """NamedShardings for an (abstract) nnx.State, read from each Variable's axis names."""
  def one(variable):
    return variable.replace(logical_to_sharding(_names_of(variable), variable.shape, mesh, rules))
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain(x, names):
  """Pin an activation's layout by logical names, using the rules of the enclosing
  `nnx.logical_axis_rules(...)` (no-op outside a mesh or without rules)."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = resolve_rules(core_spmd.get_logical_axis_rules())
  if mesh.empty or not rules:
    return x
  if set(vmapped_mesh_axes()) & set(mesh.manual_axes):
    # Inside a shard_map manual over a replica vmap's axis (a pipeline's stages under
    # train.sync), vmap would add that manual axis to the spec, which JAX refuses: the
    # stages' layouts are left to the partitioner there.
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(names, x.shape, mesh, rules))
