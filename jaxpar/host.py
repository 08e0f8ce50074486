"""What this host has, decided before JAX starts: accelerators, or only CPUs.

The `tpu` extra installs libtpu so that a CPU host can compile for TPU pods. Left alone,
JAX then initialises libtpu at start-up even with no TPU attached, which prints alarming
errors (`could not determine TPU accelerator type`, `unexpected worker hostname`) before
anything else. `import jaxpar` (and so the CLI) calls `use_cpu_without_accelerators()`;
on a TPU VM, a GPU host, or with JAX_PLATFORMS set, nothing changes.
"""

import glob
import os
import sys

_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def accelerator_device_files() -> bool:
  """TPU (/dev/accel*, /dev/vfio/N) or GPU (/dev/nvidiaN, /dev/kfd) devices on this host."""
  return any(glob.glob(pattern) for pattern in _DEVICE_FILES)


def use_cpu_without_accelerators():
  """A host with no TPU or GPU device files uses the CPU backend directly."""
  if os.environ.get("JAX_PLATFORMS") or accelerator_device_files():
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  jax = sys.modules.get("jax")
  if jax is not None and not jax.config.jax_platforms:  # imported first: it read the env already
    jax.config.update("jax_platforms", "cpu")


def prepare_topology_compile():
  """Describing a TPU topology loads libtpu. On a host with no TPU it complains that it
  cannot find this host's accelerator type and workers (telling it any type is enough: the
  topology compiled for is given explicitly), and takes a lockfile that makes a second
  process on the host fail; with no TPU there is nothing to fight over, so several may load
  it. On a TPU VM nothing changes."""
  if accelerator_device_files():
    return
  use_cpu_without_accelerators()
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
