"""`jaxpar check`: is this install right on this machine, and how fast is it here?

Prints the versions, backend and devices; measures the device's matmul rate and copy
bandwidth; runs every kernel family's door against its reference at a few shapes, a train
step, a decode step and the collectives across local devices; ends with a PASS/FAIL table
(exit 1 naming what failed) and, with --output, the same as JSON.
"""

import sys
import time

from rich.console import Console
from rich.table import Table

from jaxpar.errors import UserError

MODES = ("quick", "default", "full")
PARTS = ("kernels", "steps", "collectives")


def add_parsers(commands):
  check = commands.add_parser("check", help="verify this install on this machine's CPU, GPU or TPU and time it",
                              description=__doc__)
  depth = check.add_mutually_exclusive_group()
  depth.add_argument("--quick", dest="mode", action="store_const", const="quick",
                     help="one shape per kernel (under a minute on a GPU or TPU)")
  depth.add_argument("--full", dest="mode", action="store_const", const="full", help="more shapes")
  check.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts (default: all)")
  check.add_argument("--output", metavar="FILE.json", help="also write the results as JSON")
  check.set_defaults(func=_cmd_check, mode="default")


def _peaks(device, ceilings):
  """The rate each unit is set against: the chip's datasheet where known, else what this run
  measured ({"FLOP": (rate, source), "B": (rate, source)})."""
  from jaxpar.check.hardware import datasheet
  sheet = datasheet(device)
  if sheet is not None:
    return {"FLOP": (sheet.flops, sheet.source), "B": (sheet.bandwidth, sheet.source)}
  return {"FLOP": (ceilings.matmul_flops, f"measured {ceilings.dtype} matmul"),
          "B": (ceilings.copy_bandwidth, "measured copy")}


def run_check(mode: str = "default", parts=PARTS, console: Console | None = None):
  """-> (header dict, results). `parts`: any of kernels, steps, collectives."""
  import jax

  from jaxpar.check import collectives, hardware, kernels, steps
  if mode not in MODES:
    raise UserError(f"check mode {mode!r} is not one of {MODES}")
  console = console or Console()
  device = jax.local_devices()[0]
  accelerated = device.platform in ("tpu", "gpu")
  header = {"mode": mode, "versions": hardware.versions(), **hardware.describe_devices()}
  console.print(" ".join(f"{k} {v}" for k, v in header["versions"].items()), markup=False)
  console.print(f"backend {header['backend']}: {header['local_devices']} x {header['device_kind']} "
                f"({header['devices']} devices, {header['processes']} processes"
                f"{', topology ' + header['topology'] if header['topology'] else ''})", markup=False)
  start = time.perf_counter()
  dtype = "bfloat16" if accelerated else "float32"
  ceilings = hardware.measure_ceilings(device, dtype, 8192 if accelerated else 1024,
                                       (256 << 20) if accelerated else (64 << 20))
  header["ceilings"] = {"matmul_flops": ceilings.matmul_flops, "copy_bandwidth": ceilings.copy_bandwidth,
                        "dtype": ceilings.dtype}
  sheet = hardware.datasheet(device)
  header["datasheet"] = None if sheet is None else sheet.__dict__
  console.print(f"measured here: {ceilings.dtype} matmul {ceilings.matmul_flops / 1e12:.3g} TFLOP/s, "
                f"copy {ceilings.copy_bandwidth / 1e9:.4g} GB/s"
                + ("" if sheet is None else f"; datasheet: {sheet.source}"), markup=False)
  setting = kernels.Setting(platform=device.platform, mode=mode, peaks=_peaks(device, ceilings),
                            repeats=10 if accelerated else 3)
  runners = {"kernels": kernels.check_kernels, "steps": steps.check_steps, "collectives": collectives.check_collectives}
  results = []
  for part in PARTS:
    if part in parts:
      with console.status(f"checking {part}"):
        results += runners[part](setting)
  header["seconds"] = time.perf_counter() - start
  return header, results


def _table(results) -> Table:
  from jaxpar.check.results import table_rows
  table = Table(title="jaxpar check")
  for column in ("", "what", "shape", "error / tolerance", "time", "rate", "of peak", "note"):
    table.add_column(column, overflow="fold")
  for row in table_rows(results):
    status = f"[green]{row[0]}[/green]" if row[0] == "PASS" else f"[red]{row[0]}[/red]"
    table.add_row(status, *row[1:])
  return table


def _cmd_check(ns) -> int:
  from jaxpar.check.results import write_json
  # Piped or captured output (a log, CI) gets the whole table, not one folded to 80 columns.
  console = Console(width=None if sys.stdout.isatty() else 200)
  header, results = run_check(ns.mode, ns.only or PARTS, console)
  console.print(_table(results))
  if ns.output:
    write_json(ns.output, header, results)
  failures = [f"{r.name} ({r.shape})" for r in results if r.status == "FAIL"]
  if failures:
    console.print(f"[red]FAIL[/red]: {len(failures)} of {len(results)} checks: {'; '.join(failures)}")
    return 1
  console.print(f"[green]PASS[/green]: {len(results)} checks in {header['seconds']:.0f} s")
  return 0
