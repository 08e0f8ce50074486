"""Attention memory and time: CPU chunked path vs naive, TPU kernels vs XLA attention.

  JAX_PLATFORMS=cpu python benchmarks/attention.py [--lengths 2048 8192 32768] [--no-tpu]

CPU: one causal training step (forward + backward), batch 1, 1 head, head_dim 64,
f32; peak = arguments + outputs + temporaries from compiled.memory_analysis();
time = best of 3 after a warm-up. Naive attention is timed only where its [L, L]
buffers fit comfortably in host memory.
TPU (compile-only through libtpu): per-device memory of the training step of the
Pallas flash kernel vs jax.nn.dot_product_attention(implementation="xla"), bf16,
batch 1 per device, 8 query heads / 2 kv heads, head_dim 128, inside shard_map.
GPU: `jaxpar check` and benchmarks/gpu_sweep.py time the Triton kernels on a GPU.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.pallas_kernels import attention_reference
from jaxpar.pallas_kernels.attention.chunked import chunked_attention

_GiB = 1 << 30


def _grad_step(attn):
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2)))


def _peak(compiled):
  m = compiled.memory_analysis()
  return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def _time(fn, args, repeats=3):
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def cpu_table(lengths, time_naive_up_to=8192):
  print("CPU, causal fwd+bwd, B=1 H=1 D=64 f32")
  print(f"{'length':>7} | {'naive peak':>11} | {'chunked peak':>12} | {'naive s':>8} | {'chunked s':>9}")
  for length in lengths:
    shape = (1, length, 1, 64)
    spec = jax.ShapeDtypeStruct(shape, jnp.float32)
    row = [f"{length:>7}"]
    steps = {"naive": _grad_step(attention_reference), "chunked": _grad_step(chunked_attention)}  # causal
    compiled = {name: step.lower(spec, spec, spec).compile() for name, step in steps.items()}
    row += [f"{_peak(compiled['naive']) / 2**20:>8.0f} MiB",
            f"{_peak(compiled['chunked']) / 2**20:>9.0f} MiB"]
    args = [jax.random.normal(jax.random.key(i), shape) for i in range(3)]
    naive_s = (f"{_time(compiled['naive'], args):>8.2f}" if length <= time_naive_up_to
               else f"{'not run':>8}")
    row += [naive_s, f"{_time(compiled['chunked'], args, repeats=1 if length > 8192 else 3):>9.2f}"]
    print(" | ".join(row), flush=True)


def tpu_table(topologies_, length):
  from jax.experimental import topologies
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from jaxpar import pallas_kernels
  print(f"\nTPU compile-only, per-device bytes, causal fwd+bwd, L={length}, bf16, B=1/device, "
        "Hq=8 Hkv=2 D=128")
  print(f"{'topology':>10} | {'flash kernel':>12} | {'XLA dot_product_attention':>25}")
  axes = ("data", "stage", "fsdp", "context", "expert", "tensor")
  for name in topologies_:
    devices = np.array(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    mesh = jax.sharding.Mesh(devices.reshape(devices.size, 1, 1, 1, 1, 1), axes,
                             axis_types=(AxisType.Auto,) * 6)
    batch = devices.size
    sds = lambda h: jax.ShapeDtypeStruct((batch, length, h, 128), jnp.bfloat16,
                                         sharding=NamedSharding(mesh, P("data")))
    flash = lambda q, k, v: pallas_kernels.attention(q, k, v, pallas_kernels.AttentionSpec(implementation="flash"))
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                       implementation="xla")
    with jax.set_mesh(mesh):
      peaks = [_peak(_grad_step(f).lower(sds(8), sds(2), sds(2)).compile()) for f in (flash, xla)]
    print(f"{name:>10} | {peaks[0] / 2**20:>8.0f} MiB | {peaks[1] / 2**20:>21.0f} MiB", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
  parser.add_argument("--tpu-length", type=int, default=8192)
  parser.add_argument("--topologies", nargs="+", default=["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
  parser.add_argument("--no-tpu", action="store_true")
  args = parser.parse_args()
  cpu_table(args.lengths)
  if not args.no_tpu:
    tpu_table(args.topologies, args.tpu_length)


if __name__ == "__main__":
  main()
