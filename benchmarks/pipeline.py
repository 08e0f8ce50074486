"""Pipeline parallelism on 8 simulated CPU devices: step time and the bubble against the
microbatch count, GPipe and circular side by side with the same model unpipelined, and the
formula (S - 1) / (M * R + S - 1).

    python benchmarks/pipeline.py [--steps 8] [--layers 8] [--microbatches 4 8 16]

Every layout trains the same model on the same batches (global batch 32 x 64 tokens) with
stage=4 x fsdp=2; the unpipelined row is fsdp=8 on the same devices. How the bubble is
measured here: the 8 simulated devices share this host's cores, so a bubble iteration
(which still runs its layers on masked zeros) costs as much host time as a useful one, and
the step time grows by T / (M * R) with T = M * R + S - 1 iterations. The measured bubble is
therefore 1 - t(unpipelined) / t(pipelined): on real accelerators the bubble is idle time
instead, with the same share. The difference from the formula is the pipeline's own
overhead (hand-offs, masking, the loop) against the unpipelined program.

`--tpu` instead compiles one 70B-class model (configs/llama2-70b.yaml's shape) for two
v5p-128 slices joined over DCN (libtpu on this CPU host, nothing runs) in two layouts at one
global batch (256 x 4096 tokens): `stage` across the slices with FSDP inside each (GPipe, 4
microbatches), and FSDP across both slices. It prints HBM per chip from the compiler and the
bytes per device per step of the collectives whose groups span slices, beside the layout's
minimum across slices (jaxpar/aot/traffic.py, `minimum_dcn_bytes`).

    JAX_PLATFORMS=cpu python benchmarks/pipeline.py --tpu
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxpar.config import load_config  # noqa: E402
from jaxpar.models.pipeline import bubble_fraction  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

COMMON = ["checkpoint.enabled=false", "train.log_every=0", "train.peak_flops_per_device=1e12",
          "data.global_batch_size=32", "data.seq_len=64", "train.sample_tokens=0",
          "train.run_dir=/tmp/jaxpar-bench-pipeline"]


def step_time(overrides, steps: int) -> float:
  """Mean step time (the trainer's step clock; the compiling first step is excluded)."""
  config = load_config("tiny", COMMON + [f"train.steps={steps}"] + overrides)
  return Trainer(config).fit(show_progress=False).summary["step_time_s"]


TPU_LAYOUTS = {
  "stage over DCN": ["mesh.stage=2", "mesh.fsdp=-1", "mesh.dcn_axis=stage", "parallel.pipeline.microbatches=4"],
  "fsdp over DCN": ["mesh.fsdp=-1", "mesh.dcn_axis=fsdp"],
}


def tpu_table(topology="v5p-128", slices=2):
  from jaxpar.aot.compile import compile_for_topology
  from jaxpar.aot.report import gib
  common = ["data.global_batch_size=256", "data.seq_len=4096", "train.logits_chunk_len=1024",
            "model.remat=full"]
  print(f"llama2-70b shape, {slices} x {topology} over DCN, global batch 256 x 4096, bf16 compute, remat=full\n")
  header = (f"{'layout':<16} {'mesh':<22} {'HBM per chip':>13} {'fits':>5} {'DCN bytes/step':>15} "
            f"{'DCN minimum':>12} {'compile':>8}")
  print(header + "\n" + "-" * len(header), flush=True)
  for name, overrides in TPU_LAYOUTS.items():
    report, _ = compile_for_topology(load_config("llama2-70b", common + overrides), topology, slices)
    mesh = " x ".join(f"{a}={s}" for a, s in report["mesh"].items())
    hbm = gib(report["memory"]["total"]) if report.get("memory") else "OOM"
    dcn = report.get("dcn") or {"wire_bytes": float("nan"), "minimum": {"total": float("nan")}}
    print(f"{name:<16} {mesh:<22} {hbm:>13} {str(report['fits']):>5} {gib(dcn['wire_bytes']):>15} "
          f"{gib(dcn['minimum']['total']):>12} {report['compile_s']:>7.0f}s", flush=True)
    print("   minimum: " + ", ".join(f"{k} {gib(v)}" for k, v in dcn["minimum"].items() if k != "total"),
          flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
  parser.add_argument("--tpu", action="store_true", help="the 2-slice TPU compile table instead")
  args = parser.parse_args()
  if args.tpu:
    return tpu_table()
  model = [f"model.num_layers={args.layers}"]
  stages = 4
  flat = step_time(model + ["mesh.fsdp=8"], args.steps)
  print(f"tiny with {args.layers} layers, global batch 32 x 64, stage={stages} x fsdp=2 (unpipelined: "
        f"fsdp=8), {args.steps} steps (the first untimed); 8 simulated devices share this host's cores\n")
  header = f"{'schedule':<16} {'M':>3} {'step ms':>8} {'vs flat':>8} {'bubble measured':>16} {'formula':>8}"
  print(header + "\n" + "-" * len(header))
  print(f"{'unpipelined':<16} {'-':>3} {1e3 * flat:>8.1f} {1.0:>8.2f} {'-':>16} {'-':>8}", flush=True)
  for schedule, repeats in (("gpipe", 1), ("circular", 2)):
    for m in args.microbatches:
      pipeline = [f"mesh.stage={stages}", "mesh.fsdp=2", f"parallel.pipeline.schedule={schedule}",
                  f"parallel.pipeline.repeats={repeats}", f"parallel.pipeline.microbatches={m}"]
      t = step_time(model + pipeline, args.steps)
      name = schedule if repeats == 1 else f"{schedule} R={repeats}"
      print(f"{name:<16} {m:>3} {1e3 * t:>8.1f} {t / flat:>8.2f} {100 * (1 - flat / t):>15.1f}% "
            f"{100 * bubble_fraction(stages, m, repeats):>7.1f}%", flush=True)


if __name__ == "__main__":
  main()
