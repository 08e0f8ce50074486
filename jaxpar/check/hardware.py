"""What this machine is and how fast it could go: the datasheet peak of known chips, and the
matmul rate and copy bandwidth measured here (the ceilings a kernel's time is set against)."""

import dataclasses
import importlib.metadata
import platform as host_platform
import statistics
import time

import jax
import jax.numpy as jnp

from jaxpar.aot.chips import CHIPS as TPU_CHIPS


@dataclasses.dataclass(frozen=True)
class Datasheet:
  flops: float  # dense bf16 FLOP/s per device
  bandwidth: float  # memory bytes/s per device
  source: str


# NVIDIA datasheets (SXM parts, dense, no sparsity). Matched against the device kind's text.
_GPUS = (
  ("H200", Datasheet(989e12, 4.8e12, "NVIDIA H200 datasheet: 989 TFLOP/s bf16, 4.8 TB/s")),
  ("H100", Datasheet(989e12, 3.35e12, "NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16, 3.35 TB/s")),
  ("A100", Datasheet(312e12, 2.04e12, "NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s bf16, 2.04 TB/s")),
  ("L4", Datasheet(121e12, 0.3e12, "NVIDIA L4 datasheet: 121 TFLOP/s bf16, 300 GB/s")),
)


def datasheet(device) -> Datasheet | None:
  """The published peak of `device`'s chip, or None for a chip not in the tables (CPUs)."""
  kind = device.device_kind
  if device.platform == "gpu":
    return next((sheet for name, sheet in _GPUS if name in kind), None)
  if device.platform == "tpu":
    lower = kind.lower().replace(" ", "")
    for name, chip in TPU_CHIPS.items():
      if name in lower or (name == "v5e" and "lite" in lower and "v5" in lower) or (
          name == "v6e" and "v6" in lower):
        return Datasheet(chip.peak_flops, chip.hbm_bandwidth, f"Cloud TPU {name} page")
  return None


@dataclasses.dataclass(frozen=True)
class Ceilings:
  """What this device did in this run: the best a plain XLA matmul and copy reached."""
  matmul_flops: float  # in `dtype`
  copy_bandwidth: float  # bytes read + written per second
  dtype: str


def median_seconds(fn, *args, repeats: int = 10) -> float:
  """Median time of one `fn(*args)` after a warm-up call (compile, first run). Each sample
  times enough back-to-back calls to last about 5 ms, waited for once at the end, so the
  host's dispatch overlaps the device's work as it does in a real loop."""
  jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  calls = max(1, min(100, int(5e-3 / max(time.perf_counter() - start, 1e-6))))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times)


def measure_ceilings(device, dtype, matmul_size: int, copy_bytes: int) -> Ceilings:
  """A square `matmul_size` matmul in `dtype` on random data (zeros run faster on some chips)
  and a copy of `copy_bytes`; both the median of 10 after a warm-up."""
  a, b = (jax.device_put(jax.random.normal(jax.random.key(i), (matmul_size, matmul_size), dtype), device)
          for i in range(2))
  seconds = median_seconds(jax.jit(lambda x, y: x @ y), a, b)
  flops = 2 * matmul_size ** 3 / seconds
  x = jax.device_put(jax.random.normal(jax.random.key(2), (copy_bytes // 4,), jnp.float32), device)
  # x + 1 keeps XLA from eliding the copy; one read and one write of every element.
  seconds = median_seconds(jax.jit(lambda x: x + 1), x)
  return Ceilings(flops, 2 * x.nbytes / seconds, jnp.dtype(dtype).name)


def versions() -> dict:
  names = ("jaxpar", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "libtpu", "jax-cuda12-plugin",
           "jax-cuda13-plugin")
  found = {"python": host_platform.python_version()}
  for name in names:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return found


def describe_devices() -> dict:
  devices = jax.local_devices()
  first = devices[0]
  return {"backend": jax.default_backend(), "device_kind": first.device_kind,
          "local_devices": len(devices), "devices": jax.device_count(), "processes": jax.process_count(),
          "topology": _topology(devices)}


def _topology(devices) -> str | None:
  coords = [getattr(d, "coords", None) for d in devices]
  if any(c is None for c in coords):
    return None
  extent = [max(c[i] for c in coords) - min(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
  return "x".join(map(str, extent))
