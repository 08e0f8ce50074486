"""`jax.shard_map` stated in logical names: the one door for hand-written per-device code.

Pallas kernels, ring attention, MoE dispatch and pipeline hand-offs name their inputs'
and outputs' axes logically (`batch`, `act_heads`, `length`, ...); the specs come from
the same rules as every parameter and activation, so a mesh axis is named in one place.
"""

import contextlib
import contextvars
import math

import jax
from flax.core import spmd as core_spmd
from jax.sharding import PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.mesh.rules import PRESETS, resolve_rules

DEFAULT_RULES = "fsdp_tp"
_VMAPPED = contextvars.ContextVar("vmapped_mesh_axes", default=())


@contextlib.contextmanager
def vmapped_over_mesh_axis(axis: str):
  """Kernels traced inside `jax.vmap(..., spmd_axis_name=A)` (train.sync's replicas, one
  per `data` device group) run their shard_maps without check_vma: JAX's per-value tracking
  marks every value of a shard_map under such a vmap as varying over A, so an output the
  vmap leaves unbatched (a gradient of the kernel's replicated input, say) fails the check
  although it is replicated over A. vmap's own batching places those outputs; the replicas'
  tests compare every parameter with all-reduce training. A shard_map manual over some axes
  only (a pipeline's) reads `vmapped_mesh_axes` to make A manual as well."""
  token = _VMAPPED.set(_VMAPPED.get() + (axis,))
  try:
    yield
  finally:
    _VMAPPED.reset(token)


def vmapped_mesh_axes() -> tuple[str, ...]:
  """The mesh axes an enclosing `vmapped_over_mesh_axis` maps over: a shard_map manual over
  only some axes must make these manual too, since vmap splits its batched inputs over them."""
  return _VMAPPED.get()


def current_rules():
  """The rules of the enclosing `nnx.logical_axis_rules(...)`; the default preset outside one
  (a kernel must still run per device on a mesh, whoever called it)."""
  return resolve_rules(core_spmd.get_logical_axis_rules() or PRESETS[DEFAULT_RULES])


def _free_axes(mesh, rules, name):
  """Mesh axes `name` maps to that are real here: present, size > 1, not already manual."""
  if name is None:
    return ()
  table = dict(rules)
  if name not in table:
    raise ConfigError(f"logical axis {name!r} has no rule; add it to mesh.rules")
  return tuple(a for a in table[name]
               if a in mesh.axis_names and mesh.shape[a] > 1 and a not in mesh.manual_axes)


def mesh_axes(name, size: int | None = None, mesh=None, rules=None) -> tuple[str, ...]:
  """The mesh axes (size > 1) the logical axis `name` is split over in the current context;
  with `size`, those that `logical_shard_map` splits a dimension of that size over (so
  per-device code knows which axes its collectives run on)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty:
    return ()
  rules = rules or current_rules()
  if size is None:
    return _free_axes(mesh, rules, name)
  return _axes_per_name(mesh, rules, [((name,), (size,))])[name]


def num_shards(name, mesh=None, rules=None) -> int:
  """How many pieces the logical axis `name` is split into in the current context."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  return math.prod(mesh.shape[a] for a in mesh_axes(name, mesh=mesh, rules=rules))


def _axes_per_name(mesh, rules, named_shapes):
  """For each logical name: the longest prefix of its mesh axes whose product divides every
  dimension carrying that name, so all arguments agree on how the name is split."""
  sizes = {}
  for names, shape in named_shapes:
    for name, size in zip(names, shape):
      if name is not None:
        sizes.setdefault(name, []).append(size)
  chosen = {}
  for name, dims in sizes.items():
    axes, product = [], 1
    for axis in _free_axes(mesh, rules, name):
      if all(d % (product * mesh.shape[axis]) == 0 for d in dims):
        axes.append(axis)
        product *= mesh.shape[axis]
      else:
        break
    chosen[name] = tuple(axes)
  return chosen


def _spec(names, chosen) -> PartitionSpec:
  used, dims = set(), []
  for name in names:
    axes = tuple(a for a in chosen.get(name, ()) if a not in used) if name else ()
    used.update(axes)
    dims.append(axes[0] if len(axes) == 1 else (axes or None))
  return PartitionSpec(*dims)


def logical_shard_map(fn, in_names, out_names, *, sum_over=(), check_vma=True):
  """Wrap `fn` to run per device over the current mesh.

  in_names[i]: the logical names of argument i's dimensions (None for a replicated
  dimension), or None for an argument passed through unchanged (e.g. an absent
  `segment_ids`). out_names: the names of the one output, or a list of them for several.
  sum_over: names of contracted dimensions: where the mesh splits them, each device's
  outputs are partial sums, added up (psum) over those mesh axes before they leave.
  check_vma: jax.shard_map's per-value tracking of which mesh axes a value varies over.
  A name whose mesh axes do not divide every dimension that carries it is split over the
  longest prefix of those axes that does (possibly none: replicated). Without a mesh, or
  on a mesh whose free axes are all size 1, `fn` is called directly.
  """
  def wrapped(*args):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or math.prod(mesh.shape[a] for a in mesh.axis_names
                               if a not in mesh.manual_axes) == 1:
      return fn(*args)
    rules = current_rules()
    present = [i for i, (x, names) in enumerate(zip(args, in_names))
               if names is not None and x is not None]
    chosen = _axes_per_name(mesh, rules, [(in_names[i], args[i].shape) for i in present])
    several = isinstance(out_names, list)
    out_specs = tuple(_spec(n, chosen) for n in out_names) if several else _spec(out_names, chosen)

    summed = tuple(a for name in sum_over for a in chosen.get(name, ()))

    def per_device(*present_args):
      full = list(args)
      for i, x in zip(present, present_args):
        full[i] = x
      out = fn(*full)
      return jax.tree.map(lambda o: jax.lax.psum(o, summed), out) if summed else out

    in_specs = tuple(_spec(in_names[i], chosen) for i in present)
    return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=check_vma and not _VMAPPED.get())(*(args[i] for i in present))
  return wrapped
