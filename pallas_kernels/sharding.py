"""Run a per-device attention kernel on the current mesh with `jax.shard_map`.

Mosaic and Triton kernels are opaque to XLA's partitioner, so each device gets its
own batch slice (data, fsdp axes) and head slice (tensor axis) explicitly.
"""

import jax
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
HEAD_AXES = ("tensor",)


def current_platform():
  """Platform the current computation compiles for: the mesh's devices, else the default."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.abstract_device is not None:
    return mesh.abstract_device.platform
  return jax.default_backend()


def current_device_kind():
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.abstract_device is not None:
    return mesh.abstract_device.device_kind
  return jax.devices()[0].device_kind


def _axes_dividing(mesh, names, *sizes):
  """The longest prefix of `names` (present, not manual, size > 1) whose product divides all sizes."""
  chosen, product = [], 1
  for name in names:
    if name not in mesh.axis_names or name in mesh.manual_axes:
      continue
    n = mesh.shape[name]
    if n > 1 and all(size % (product * n) == 0 for size in sizes):
      chosen.append(name)
      product *= n
  return tuple(chosen) or None


def shard_over_mesh(kernel, args, layouts):
  """Call kernel(*args) per device on the current mesh (directly when there is none).

  layouts[i] = (batch_dim, head_dim) of args[i], either None; args[0] is the query and
  the output has its layout. Batch is split over the data/fsdp axes that divide it,
  heads over tensor when it divides every head dim; otherwise they stay replicated.
  None args pass through.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or all(mesh.shape[a] == 1 or a in mesh.manual_axes for a in mesh.axis_names):
    return kernel(*args)
  present = [i for i, x in enumerate(args) if x is not None]
  batch_sizes = [args[i].shape[layouts[i][0]] for i in present if layouts[i][0] is not None]
  head_sizes = [args[i].shape[layouts[i][1]] for i in present if layouts[i][1] is not None]
  batch = _axes_dividing(mesh, BATCH_AXES, *batch_sizes)
  heads = _axes_dividing(mesh, HEAD_AXES, *head_sizes)

  def spec(i):
    dims = [None] * args[i].ndim
    batch_dim, head_dim = layouts[i]
    if batch_dim is not None:
      dims[batch_dim] = batch
    if head_dim is not None:
      dims[head_dim] = heads
    return P(*dims)

  def per_device(*present_args):
    full = list(args)
    for i, x in zip(present, present_args):
      full[i] = x
    return kernel(*full)

  return jax.shard_map(per_device, mesh=mesh, in_specs=tuple(spec(i) for i in present),
                       out_specs=spec(0))(*(args[i] for i in present))
