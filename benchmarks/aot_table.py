"""Compile every shipped pod config at full depth for the TPU slice named in its file (libtpu
on this CPU host) and print estimated MFU, step time and per-device memory next to the MFU
MaxText publishes for the same model and chip.

The two MFU columns are different things: ours is a roofline *estimate* from the compiled
program (jaxpar/aot/roofline.py: model FLOPs / chip peak, collectives / ICI bandwidth,
optimizer traffic / HBM bandwidth; no kernel inefficiency, so an upper bound); MaxText's is a
*measurement* on real chips. MoE rows (mixtral-8x7b): no MoE model exists in jaxpar yet.

  JAX_PLATFORMS=cpu python benchmarks/aot_table.py [--configs llama3-8b ...] [--json out.json]

`--plan-cpu CONFIG` instead runs `jaxpar plan --measure` on 8 simulated CPU devices: measured
step times of the planner's candidates, the rank correlation with its predictions, and the
winner against the config's own layout.
"""

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

from jaxpar.aot.compile import compile_for_topology  # noqa: E402
from jaxpar.aot.plan import run_plan  # noqa: E402
from jaxpar.aot.report import format_report  # noqa: E402
from jaxpar.config import load_config  # noqa: E402

# Measured MFU, from MaxText's README performance table (github.com/AI-Hypercomputer/maxtext).
MAXTEXT_MFU = {("llama3-8b", "v6e-256"): 0.4546, ("llama3-70b", "v6e-256"): 0.5033,
               ("llama2-70b", "v5p-512"): 0.654}
CONFIGS = ["llama3-8b", "llama3-70b", "llama2-70b", "llama2-7b", "mistral-7b", "qwen2.5-7b"]


def row(name: str) -> dict:
  config = load_config(name)
  report, _ = compile_for_topology(config, config.mesh.topology)
  print(f"--- {name}\n{format_report(report)}", flush=True)
  return {"config": name, **report}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="*", default=CONFIGS)
  parser.add_argument("--json", help="also write the full reports here")
  parser.add_argument("--plan-cpu", metavar="CONFIG", help="measure the planner on 8 CPU devices")
  args = parser.parse_args()
  if args.plan_cpu:
    run_plan(load_config(args.plan_cpu), top=4, measure=True, output="/dev/null")
    return
  rows = [row(name) for name in args.configs]
  print("\n| config | topology | fits | HBM/device | est. step | est. MFU | compiler optimal_s "
        "| MaxText measured MFU |\n|---|---|---|---|---|---|---|---|")
  for r in rows:
    published = MAXTEXT_MFU.get((r["config"], r["topology"]))
    if r["oom"] is not None:
      print(f"| {r['config']} | {r['topology']} | no (OOM) | - | - | - | - | "
            f"{f'{100 * published:.2f}%' if published else '-'} |")
      continue
    e, optimal = r["estimate"], r["compiler_optimal_s"]
    # Sane: positive and within 2x of ours; otherwise shown in parentheses (one loop trip only).
    compiler = ("unusable" if not optimal else f"{optimal:.2f} s" if
                0.5 <= optimal / e["step_s"] <= 2 else f"({optimal:.2f} s, not sane)")
    print(f"| {r['config']} | {r['topology']} | {'yes' if r['fits'] else 'no'} | "
          f"{r['memory']['total'] / 2 ** 30:.1f} GiB | {e['step_s']:.2f} s | {100 * e['mfu']:.1f}% | "
          f"{compiler} | "
          f"{f'{100 * published:.2f}%' if published else '-'} |")
  print("\nest. = our roofline estimate from the compiled program (matmuls at peak, collectives "
        "not overlapped: see jaxpar/aot/roofline.py); MaxText = measured on hardware. "
        "mixtral-8x7b: not run, jaxpar has no MoE model yet.")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
