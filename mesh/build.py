"""Build the named device mesh: axes `data, stage, fsdp, context, expert, tensor`."""

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxpar.errors import ConfigError

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


def _simulate_hint() -> str:
  """On a CPU host, more devices are a flag away."""
  return (" (on CPU, simulate N devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)"
          if jax.default_backend() == "cpu" else "")


def resolve_axis_sizes(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
  """Fill the one `-1` axis with the remaining devices; check the product."""
  fixed = math.prod(s for s in sizes.values() if s != -1)
  free = [a for a, s in sizes.items() if s == -1]
  resolved = dict(sizes)
  if free:
    if num_devices % fixed:
      shown = " x ".join(f"{a}={s}" for a, s in sizes.items() if s not in (1, -1))
      raise ConfigError(f"mesh {shown} needs a multiple of {fixed} devices but {num_devices} "
                        f"{'is' if num_devices == 1 else 'are'} available: make the mesh smaller "
                        f"or use more devices{_simulate_hint()}")
    resolved[free[0]] = num_devices // fixed
  total = math.prod(resolved.values())
  if total != num_devices:
    shown = " x ".join(f"{a}={s}" for a, s in resolved.items() if s != 1) or "all 1"
    raise ConfigError(f"mesh {shown} needs {total} devices but {num_devices} are available: "
                     f"change the mesh sizes or set one axis to -1{_simulate_hint()}")
  return resolved


def build_mesh(mesh_config, devices=None) -> Mesh:
  """A Mesh with every axis (size-1 ones too, so specs never change shape), Auto types.

  With `num_slices > 1` the `dcn_axis` spans slices (slow data-center network) and the
  other axes stay inside a slice (fast ICI links).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_axis_sizes(mesh_config.axis_sizes(), len(devices))
  shape = tuple(sizes[a] for a in AXES)
  slices = mesh_config.num_slices
  if slices > 1:
    dcn_index = AXES.index(mesh_config.dcn_axis)
    if shape[dcn_index] % slices:
      raise ConfigError(f"mesh.{mesh_config.dcn_axis}={shape[dcn_index]} must be a multiple of "
                       f"mesh.num_slices={slices}")
    ici = list(shape)
    ici[dcn_index] //= slices
    dcn = [1] * len(AXES)
    dcn[dcn_index] = slices
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                                allow_split_physical_axes=True)
  elif devices[0].platform in ("cpu",):
    grid = np.array(devices).reshape(shape)
  else:
    grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
