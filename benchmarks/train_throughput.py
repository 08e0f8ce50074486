"""Training throughput: tokens/s, step time and MFU on 1 CPU device and 8 simulated ones.

    python benchmarks/train_throughput.py [--steps 10] [--configs bench-20m bench-50m]

MFU = model FLOPs (6 x matmul params x tokens + causal attention) / the f32 matmul rate
of this host, measured in the same run. Simulated devices share the host's cores, so
8-device MFU is against the same one-host peak.
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.train.flops import measure_matmul_flops, train_flops_per_token  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

LAYOUTS = [  # name, number of devices, mesh overrides, global batch multiplier
  ("1 device", 1, ["mesh.fsdp=1"], 1),
  ("1 device, batch x8", 1, ["mesh.fsdp=1"], 8),
  ("fsdp8", 8, ["mesh.fsdp=8"], 8),
  ("fsdp4 x tp2", 8, ["mesh.fsdp=4", "mesh.tensor=2"], 8),
]


def time_steps(trainer, steps: int) -> float:
  """Seconds per step after two warm-up steps (compile + first run)."""
  state = trainer.init_state()
  batches = trainer.batches()
  for _ in range(2):
    state, metrics = trainer.step(state, next(batches))
  jax.block_until_ready(metrics)
  data = [next(batches) for _ in range(steps)]
  start = time.perf_counter()
  for batch in data:
    state, metrics = trainer.step(state, batch)
  jax.block_until_ready((state, metrics))
  return (time.perf_counter() - start) / steps


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--configs", nargs="+", default=["bench-20m", "bench-50m"])
  args = parser.parse_args()

  peak_f32 = measure_matmul_flops(jnp.float32)
  peak_bf16 = measure_matmul_flops(jnp.bfloat16)
  print(f"host matmul rate (2048^3, best of 5): f32 {peak_f32 / 1e9:.1f} GFLOP/s, "
        f"bf16 {peak_bf16 / 1e9:.1f} GFLOP/s; {os.cpu_count()} cores\n")
  header = f"{'config':<10} {'layout':<20} {'batch':>5} {'params':>8} {'step ms':>8} {'tokens/s':>9} {'MFU':>6}"
  print(header)
  print("-" * len(header))
  for name in args.configs:
    base = load_config(name)
    for layout, devices, mesh, multiplier in LAYOUTS:
      batch = base.data.global_batch_size * multiplier
      config = load_config(name, mesh + [f"data.global_batch_size={batch}"])
      trainer = Trainer(config, devices=jax.devices()[:devices])
      step_time = time_steps(trainer, args.steps)
      tokens = batch * config.data.seq_len
      mfu = train_flops_per_token(config.model, config.data.seq_len) * tokens / step_time / peak_f32
      print(f"{name:<10} {layout:<20} {batch:>5} {trainer.num_params / 1e6:>7.1f}M "
            f"{step_time * 1e3:>8.1f} {tokens / step_time:>9,.0f} {100 * mfu:>5.1f}%", flush=True)


if __name__ == "__main__":
  main()
