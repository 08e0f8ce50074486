"""Compile configs at full depth for the TPU slice named in each file (libtpu on this CPU
host) and print, per config: HBM per chip (device, and host memory holding offloaded
activations), collective bytes on the wire per device per step against the layout's
minimum (jaxpar/aot/traffic.py), compiled FLOPs against model FLOPs, and the estimated step
time and MFU, next to the MFU MaxText publishes for the same model, shape and chip.

The default configs are the published JAX recipes' shapes (configs/llama3.1-8b-v6e-256.yaml,
llama3.1-70b-v6e-256, llama2-70b-v5p-512); any shipped config can be named instead.

The two MFU columns are different things: ours is a roofline *estimate* from the compiled
program (jaxpar/aot/roofline.py: every op at its own roofline, loop trips counted, Pallas
kernels by their cost estimates, collectives over ICI bandwidth, nothing overlapped);
MaxText's is a *measurement* on real chips.

  JAX_PLATFORMS=cpu python benchmarks/aot_table.py [--configs NAME ...] [--set KEY=VALUE ...] [--json out.json]
  (11 minutes for the three recipes on a 2-core host)

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

GIB = 2 ** 30
RECIPES = ["llama3.1-8b-v6e-256", "llama3.1-70b-v6e-256", "llama2-70b-v5p-512"]
# HBM per chip of the published recipes at the same shape (the targets), and the MFU
# MaxText measured (its README performance tables, github.com/AI-Hypercomputer/maxtext).
TARGET_HBM_GIB = {"llama3.1-8b-v6e-256": 11, "llama3.1-70b-v6e-256": 24, "llama2-70b-v5p-512": 76}
MAXTEXT_MFU = {"llama3.1-8b-v6e-256": 0.4546, "llama3.1-70b-v6e-256": 0.5033,
               "llama2-70b-v5p-512": 0.654, "llama3-8b": 0.4546, "llama3-70b": 0.5033,
               "llama2-70b": 0.654}


def row(name: str, overrides=()) -> dict:
  config = load_config(name, list(overrides))
  report, _ = compile_for_topology(config, config.mesh.topology)
  print(f"--- {name}\n{format_report(report)}", flush=True)
  return {"config": name, **report}


def table_line(r: dict) -> str:
  target = TARGET_HBM_GIB.get(r["config"])
  published = MAXTEXT_MFU.get(r["config"])
  cells = [r["config"], r["topology"]]
  if r["oom"] is not None:
    cells += ["DOES NOT FIT", "-", "-", "-", "-", "-"]
  else:
    m, e, t = r["memory"], r["estimate"], r["traffic"]
    cells += [f"{m['total'] / GIB:.1f} GiB" + (f" (target <= {target})" if target else ""),
              f"{m['host_total'] / GIB:.1f} GiB",
              f"{t['wire_bytes'] / GIB:.1f} / {t['minimum']['total'] / GIB:.1f} GiB "
              f"({t['ratio']:.2f}x; as written {t['wire_bytes_as_written'] / GIB:.1f}, "
              f"{t['wire_bytes_as_written'] / t['minimum']['total']:.2f}x)",
              f"{r['compiled_flops_per_step'] / r['model_flops_per_step']:.2f}x",
              f"{e['step_s']:.2f} s", f"{100 * e['mfu']:.1f}%"]
  cells.append(f"{100 * published:.2f}%" if published else "-")
  return "| " + " | ".join(cells) + " |"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", nargs="*", default=RECIPES)
  parser.add_argument("--json", help="also write the full reports here")
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="overrides for every config, e.g. train.optimizer_state_dtype=int8_blockwise")
  parser.add_argument("--plan-cpu", metavar="CONFIG", help="measure the planner on 8 CPU devices")
  args = parser.parse_args()
  if args.plan_cpu:
    run_plan(load_config(args.plan_cpu), top=4, measure=True, output="/dev/null")
    return
  rows = [row(name, args.set) for name in args.configs]
  print("\n| config | topology | HBM per chip | host per chip | collectives on wire / minimum "
        "| compiled / model FLOPs | est. step | est. MFU | MaxText measured MFU |\n"
        "|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(table_line(r))
  print("\nPer device per step. est. = our roofline estimate from the compiled program (every "
        "op at its roofline, collectives not overlapped: jaxpar/aot/roofline.py), not a "
        "measurement; MaxText = measured on hardware.")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2, default=str)


if __name__ == "__main__":
  main()
