"""Which backend and chip the current computation compiles for, and whether a Pallas
kernel must run in interpret mode (anything but TPU and GPU)."""

import jax


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


def interpret(platform=None) -> bool:
  """Pallas kernels compile natively on TPU (Mosaic) and GPU (Triton); elsewhere they run
  in interpret mode, which is how the CPU tests check their numerics."""
  return (platform or current_platform()) not in ("tpu", "gpu")


def multiprocessors() -> int:
  """Cores a GPU kernel's grid spreads over: the device's (a GPU's multiprocessors); 128
  where a backend does not say (CPU, where kernels only run interpreted)."""
  return getattr(jax.local_devices()[0], "core_count", None) or 128
