"""Mixture of experts: tiny-moe throughput and load balance on 8 simulated CPU devices with
expert parallelism EP = 1, 2, 4, 8; the grouped-matmul implementations side by side on one
device; and mixtral-8x7b's per-chip HBM and estimated step time on a TPU v5p-256 slice at
36 x 4096 tokens per chip (full depth, compiled with libtpu on this host; an estimate).

    python benchmarks/moe.py [--steps 12] [--skip-cpu] [--skip-tpu] [--tpu-overrides mesh.expert=8]

Every layout trains from the same initial weights on the same batches, so the experts'
load is the same in each: what EP changes is how it falls on devices (a device's share is
the sum of its experts' loads). Load numbers are means over the timed steps.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

COMMON = ["checkpoint.enabled=false", "train.log_every=0", "train.peak_flops_per_device=1e12"]


def run(overrides, steps: int, devices: int) -> dict:
  """tokens/s (the trainer's step clock, warm-up excluded) and per-step load statistics."""
  config = load_config("tiny-moe", COMMON + [f"train.steps={steps}", "train.run_dir=/tmp/jaxpar-bench-moe"]
                       + overrides)
  result = Trainer(config, devices=jax.devices()[:devices]).fit(show_progress=False)
  timed = result.history[2:]
  experts = config.model.moe.num_experts
  load = np.array([[h[f"moe/load/{i}"] for i in range(experts)] for h in timed])
  ep = config.mesh.expert
  per_device = load.reshape(len(timed), ep, experts // ep).sum(-1)
  return {"tokens_per_s": result.summary["tokens_per_s"],
          "expert_imbalance": float(np.mean([h["moe/imbalance"] for h in timed])),
          "device_imbalance": float(np.mean(per_device.max(-1) * ep)),
          "dropped": float(np.mean([h["moe/dropped"] for h in timed])), "loss": timed[-1]["loss"]}


def cpu_tables(steps: int):
  print(f"tiny-moe (8 experts, top-2), global batch 32 x 128, {steps} steps "
        "(the first 2 untimed); 8 simulated devices share this host's cores\n")
  header = (f"{'layout':<24} {'tokens/s':>9} {'experts max/mean':>17} {'devices max/mean':>17} "
            f"{'dropped':>8} {'loss':>6}")
  print(header + "\n" + "-" * len(header))
  layouts = [(f"EP={ep} x fsdp={8 // ep}", [f"mesh.expert={ep}", f"mesh.fsdp={8 // ep}"]) for ep in (1, 2, 4, 8)]
  layouts.append(("EP=8, buffer 1.25x", ["mesh.expert=8", "mesh.fsdp=1", "model.moe.ep_buffer_factor=1.25"]))
  for name, overrides in layouts:
    r = run(overrides, steps, 8)
    print(f"{name:<24} {r['tokens_per_s']:>9,.0f} {r['expert_imbalance']:>17.2f} "
          f"{r['device_imbalance']:>17.2f} {100 * r['dropped']:>7.2f}% {r['loss']:>6.3f}", flush=True)

  print("\ngrouped SwiGLU implementations, tiny-moe on 1 device (tiny, dense, same active "
        "matmul work per token, for scale)\n")
  header = f"{'implementation':<24} {'tokens/s':>9} {'vs blocked':>11}"
  print(header + "\n" + "-" * len(header))
  blocked = None
  for impl in ("blocked", "ragged", "reference"):
    r = run([f"model.moe.implementation={impl}", "mesh.fsdp=1"], steps, 1)
    blocked = blocked or r["tokens_per_s"]
    print(f"{impl:<24} {r['tokens_per_s']:>9,.0f} {r['tokens_per_s'] / blocked:>10.2f}x", flush=True)
  config = load_config("tiny", COMMON + [f"train.steps={steps}", "mesh.fsdp=1", "train.run_dir=/tmp/jaxpar-bench-moe"])
  dense = Trainer(config, devices=jax.devices()[:1]).fit(show_progress=False).summary["tokens_per_s"]
  print(f"{'dense tiny (MLP 384)':<24} {dense:>9,.0f} {dense / blocked:>10.2f}x", flush=True)


def tpu_table(overrides):
  from jaxpar.aot.compile import compile_for_topology
  from jaxpar.aot.report import format_report
  config = load_config("mixtral-8x7b", overrides)
  print(f"\nmixtral-8x7b on {config.mesh.topology}, {config.data.global_batch_size} x "
        f"{config.data.seq_len} tokens, full depth ({config.model.num_layers} layers) "
        f"{' '.join(overrides)}")
  report, _ = compile_for_topology(config, config.mesh.topology)
  print(format_report(report), flush=True)
  if report["oom"] is None:
    chips = report["devices"]
    print(f"\nper chip: {report['memory']['total'] / 2 ** 30:.1f} GiB HBM (the published JAX "
          f"recipe compiles to about 89 GiB); estimated step {report['estimate']['step_s']:.2f} s, "
          f"{config.data.global_batch_size * config.data.seq_len / report['estimate']['step_s'] / chips:,.0f} "
          "tokens/s per chip (estimates: jaxpar/aot/roofline.py)")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--skip-cpu", action="store_true")
  parser.add_argument("--skip-tpu", action="store_true")
  parser.add_argument("--tpu-overrides", nargs="*", default=[], help="overrides of mixtral-8x7b")
  args = parser.parse_args()
  if not args.skip_cpu:
    cpu_tables(args.steps)
  if not args.skip_tpu:
    tpu_table(args.tpu_overrides)


if __name__ == "__main__":
  main()
