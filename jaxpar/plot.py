"""`jaxpar plot RUN_DIR [RUN_DIR ...]`: one PNG of what training logged (metrics.jsonl),
runs overlaid in one colour each: loss (with eval loss dashed, when a run has one),
learning rate, tokens/s and MFU against step; reward (held-out pass@1 dashed) and response
length too for reinforcement learning runs.

    fig = jaxpar.plot_runs(["runs/a", "runs/b"], output="runs.png")   # a matplotlib Figure

Needs matplotlib (`pip install 'jaxpar[plot]'`). Keys are read as they come: a run
without tokens/s (one step) or without eval leaves those lines out, never fails.
"""

import json
from pathlib import Path

from jaxpar.errors import DataError, UserError

# (panel title, metrics key, scale shown)
PANELS = (("loss", "loss", 1.0), ("learning rate", "lr", 1.0), ("tokens/s", "tokens_per_s", 1.0),
          ("MFU (%)", "mfu", 100.0))
# Reinforcement learning's, when a run logged them (train.objective=grpo).
RL_PANELS = (("reward (held-out pass@1 dashed)", "reward", 1.0), ("response length (tokens)", "response_length", 1.0))


def read_metrics(run_dir) -> list[dict]:
  """The records of `run_dir`/metrics.jsonl by step; a step logged twice (a run resumed from
  an earlier checkpoint) keeps its last record."""
  path = Path(run_dir) / "metrics.jsonl"
  if not path.is_file():
    raise DataError(f"{run_dir} has no metrics.jsonl: give a run directory (train.run_dir) of a run "
                    "that has logged a step")
  by_step = {}
  for line in path.read_text().splitlines():
    if line.strip():
      record = json.loads(line)
      by_step.setdefault(record["step"], {}).update(record)
  return [by_step[step] for step in sorted(by_step)]


def eval_loss_keys(records) -> list[str]:
  """Held-out losses, however the evaluation names them: `eval_loss`, `eval/loss`, `eval/NAME/loss`."""
  keys = {k for r in records for k in r if k == "eval_loss" or (k.startswith("eval/") and k.endswith("loss"))}
  return sorted(keys)


def _labels(run_dirs) -> list[str]:
  """Each run's directory name; its path where two names clash."""
  names = [Path(d).name or str(d) for d in run_dirs]
  return [str(d) if names.count(n) > 1 else n for d, n in zip(run_dirs, names)]


def _series(records, key, scale):
  points = [(r["step"], r[key] * scale) for r in records if r.get(key) is not None]
  return [s for s, _ in points], [v for _, v in points]


def plot_runs(run_dirs, output=None, *, labels=None):
  """A matplotlib Figure with one panel per metric (PANELS) and a line per run; saved as
  a PNG at `output` when given."""
  try:
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter
  except ImportError:
    raise UserError("jaxpar plot needs matplotlib: pip install 'jaxpar[plot]'") from None
  runs = [read_metrics(d) for d in run_dirs]
  labels = labels or _labels(run_dirs)
  panels = PANELS + (RL_PANELS if any("reward" in r for records in runs for r in records) else ())
  figure = Figure(figsize=(12, 3.75 * len(panels) // 2), layout="constrained")
  axes = list(figure.subplots(len(panels) // 2, 2, sharex=True).flat)
  colours = [f"C{i % 10}" for i in range(len(runs))]
  for ax, (title, key, scale) in zip(axes, panels):
    for records, label, colour in zip(runs, labels, colours):
      ax.plot(*_series(records, key, scale), color=colour, label=label, linewidth=1.4)
      if key == "reward":
        ax.plot(*_series(records, "heldout_pass@1", 1.0), color=colour, linestyle="--", marker="o", markersize=3)
      if key == "loss":
        for name in eval_loss_keys(records):
          ax.plot(*_series(records, name, 1.0), color=colour, linestyle="--", marker="o", markersize=3,
                  label=f"{label} {name}")
    ax.set_title(title + (" (eval dashed)" if key == "loss" and any(map(eval_loss_keys, runs)) else ""))
    ax.grid(alpha=0.3)
    if not ax.lines:
      ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")
  axes[0].legend(fontsize="small")
  axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
  axes[2].yaxis.set_major_formatter(EngFormatter())
  for ax in axes[-2:]:
    ax.set_xlabel("step")
  figure.suptitle("jaxpar: " + ", ".join(labels))
  if output is not None:
    figure.savefig(output, dpi=110)
  return figure


def add_parser(commands):
  plot = commands.add_parser(
      "plot", help="plot the metrics of one or more runs as a PNG",
      description="Write a PNG of loss (and eval loss), learning rate, tokens/s and MFU against step "
      "for each RUN_DIR (a train.run_dir holding metrics.jsonl), runs overlaid and labelled.")
  plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  plot.add_argument("--output", default="metrics.png", help="the PNG to write (default metrics.png)")
  plot.set_defaults(func=_cmd_plot)


def _cmd_plot(ns):
  plot_runs(ns.run_dirs, ns.output)
  print(f"wrote {ns.output} ({len(ns.run_dirs)} run{'s' * (len(ns.run_dirs) > 1)}: "
        f"{', '.join(_labels(ns.run_dirs))})")
