"""All-reduce and all-gather across the local devices: bus bandwidth (NCCL's convention, so
the number compares across device counts) and exactness."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.check.hardware import median_seconds
from jaxpar.check.results import Result, failed


def check_collectives(setting) -> list[Result]:
  devices = jax.local_devices()
  n = len(devices)
  if n < 2:
    return [Result(name, f"{n} device", status="SKIP", note="one local device") for name in ("all-reduce", "all-gather")]
  per_device = setting.pick(64 << 20, 256 << 20) if setting.accelerated else 1 << 20
  mesh = jax.sharding.Mesh(np.array(devices), ("devices",))
  sharded = NamedSharding(mesh, P("devices"))
  elements = per_device // 4
  # Row i holds i + 1 everywhere: the sum and the gather have exact expected values.
  x = jax.device_put(jnp.repeat(jnp.arange(1, n + 1, dtype=jnp.float32), elements), sharded)
  shape = f"{n} devices x {per_device >> 20} MiB"

  def all_reduce(x):
    return jax.shard_map(lambda b: jax.lax.psum(b, "devices"), mesh=mesh, in_specs=P("devices"),
                         out_specs=P("devices"))(x)

  def all_gather(x):
    return jax.shard_map(lambda b: jax.lax.all_gather(b, "devices", tiled=True), mesh=mesh,
                         in_specs=P("devices"), out_specs=P(None), check_vma=False)(x)

  results = []
  for name, fn, expected, bus_factor in (
      ("all-reduce", all_reduce, np.full(n * elements, n * (n + 1) / 2), 2 * (n - 1) / n),
      ("all-gather", all_gather, np.repeat(np.arange(1, n + 1), elements), (n - 1) / n)):
    try:
      fn = jax.jit(fn)
      out = np.asarray(fn(x))
      exact = out.shape == expected.shape and np.array_equal(out, expected)
      seconds = median_seconds(fn, x, repeats=setting.repeats)
    except Exception as e:
      results.append(failed(name, shape, e))
      continue
    # Bus bytes: what each device's links carry for this collective of `per_device` bytes each.
    results.append(Result(name, shape, "PASS" if exact else "FAIL", seconds=seconds,
                          work=bus_factor * per_device * (1 if name == "all-reduce" else n), unit="B",
                          note="bus bandwidth" if exact else "result differs from the exact sum/gather"))
  return results
