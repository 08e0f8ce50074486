"""Per-step metrics: a progress bar with ETA, JSONL in the run dir, and the trackers
(TensorBoard, wandb, mlflow: jaxpar/train/trackers.py)."""

import json
import queue
import threading
import time
from pathlib import Path

import jax
import numpy as np
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)

from jaxpar.train.trackers import open_trackers


# Shown on the progress bar next to loss, tokens/s and MFU when a model reports them.
PROGRESS_EXTRAS = {"moe/imbalance": "max/mean load {:.2f}", "moe/dropped": "dropped {:.1%}",
                   "reward": "reward {:.3f}", "response_length": "length {:.1f}",
                   "heldout_pass@1": "held-out pass@1 {:.1%}", "sync/drift": "synced (drift {:.2e})"}


def scalars(metrics: dict) -> dict[str, float]:
  """Metric values as floats; an array metric (one value per expert, say) becomes one
  scalar per element, `name/i`."""
  out = {}
  for key, value in metrics.items():
    value = np.asarray(value)
    if value.ndim == 0:
      out[key] = float(value)
    else:
      out.update({f"{key}/{i}": float(v) for i, v in enumerate(value.reshape(-1))})
  return out


class MetricsLogger:
  """Every process keeps the history; only process 0 writes files and shows progress."""

  def __init__(self, run_dir, total_steps: int, *, start_step: int = 0, console: Console | None = None,
               show_progress: bool = True, loggers=("tensorboard",), config: dict | None = None):
    self.writes = jax.process_index() == 0
    self.run_dir = Path(run_dir)
    self.start_step = start_step
    if self.writes:
      self.run_dir.mkdir(parents=True, exist_ok=True)
      _drop_records_after(self.run_dir / "metrics.jsonl", start_step)
    # Line-buffered: a job that dies (a peer failure exits at once) keeps every logged step.
    self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1) if self.writes else None
    # A start that trains nothing opens no tracker run (TensorBoard: no file).
    opens = self.writes and total_steps > start_step
    self.trackers = open_trackers(loggers, self.run_dir, config or {}, start_step) if opens else []
    self.console = console or Console()
    self.progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("eta"),
        TimeRemainingColumn(), console=self.console, disable=not (show_progress and self.writes))
    self.task = self.progress.add_task("train", total=total_steps, completed=start_step, status="compiling the step")
    self.progress.start()
    self.history: list[dict] = []
    self.last_eval = ""

  def log(self, step: int, metrics: dict, *, echo: bool = False, echo_eval: bool = False):
    values = scalars(metrics)
    record = {"step": step, "time": time.time(), **values}
    self.history.append(record)
    if not self.writes:
      return
    self.jsonl.write(json.dumps(record) + "\n")
    for tracker in self.trackers:
      tracker.log(step, values)
    extras = "".join(f"  {text.format(record[key])}" for key, text in PROGRESS_EXTRAS.items()
                     if key in record)
    evals = eval_line(record)
    if evals:
      self.last_eval = evals
    status = f"loss {record['loss']:.3f}" + (f"  {record['tokens_per_s']:,.0f} tok/s  mfu {100 * record['mfu']:.1f}%"
                                             if "tokens_per_s" in record else "") + extras
    if self.last_eval:
      status += f"  | eval {self.last_eval}"
    self.progress.update(self.task, completed=step, status=status)
    if echo:
      line = (f"step {step:>6}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
              f"lr {record['lr']:.2e}{extras}")
      if "step_time_s" in record:
        line += (f"  {record['step_time_s'] * 1e3:.0f} ms  {record['tokens_per_s']:,.0f} tok/s  "
                 f"mfu {100 * record['mfu']:.1f}%")
      self.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
    if evals and echo_eval:
      self.progress.console.print(f"eval {step:>6}  {evals}", markup=False, highlight=False, soft_wrap=True)

  def close(self):
    self.progress.stop()
    if self.writes:
      self.jsonl.close()
      for tracker in self.trackers:
        tracker.close()


def _drop_records_after(path: Path, step: int):
  """A resume from `step`: the records an interrupted start wrote after its checkpoint go
  (they are trained again), so each step appears once; so does a line cut by a kill."""
  if not path.exists():
    return
  lines = path.read_text().splitlines(keepends=True)
  kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= step]
  if len(kept) < len(lines):
    partial = path.with_suffix(".jsonl.partial")
    partial.write_text("".join(kept))
    partial.replace(path)


def eval_line(record: dict) -> str:
  """`heldout loss 2.314 ppl 10.11 bpb 3.339  wiki ...` from a record's eval/ keys."""
  names = dict.fromkeys(k.split("/")[1] for k in record if k.startswith("eval/"))
  return "  ".join(f"{n} loss {record[f'eval/{n}/loss']:.3f} ppl {record[f'eval/{n}/perplexity']:.2f} "
                   f"bpb {record[f'eval/{n}/bits_per_byte']:.3f}" for n in names)


def summary_lines(summary: dict, config) -> list[str]:
  """The end-of-run lines beyond loss and speed: the final eval, and what a mixture drew."""
  lines = []
  if "eval" in summary:
    lines.append(f"eval at step {summary['eval_step']}: {eval_line(summary['eval'])}")
  if "heldout" in summary:  # reinforcement learning's held-out prompts, before and after
    start, end = summary["heldout_start"], summary["heldout"]
    lines.append("held-out prompts: " + ", ".join(
        f"{k.removeprefix('heldout_')} {start.get(k, float('nan')):.3f} -> {v:.3f}" for k, v in end.items()))
  if "data_proportions" in summary:
    weights = {n: s.weight for n, s in config.data.named_sources().items() if s.weight > 0}
    total = sum(weights.values())
    lines.append("data drawn: " + ", ".join(f"{name} {share:.1%} (weight {weights[name] / total:.1%})"
                                            for name, share in summary["data_proportions"].items()))
  return lines


class StepClock:
  """When each dispatched step finished, seen from a background thread.

  The loop reads a step's metrics one step late to keep dispatch asynchronous, so the
  moment it reads them says little about when the step ended (on CPU the next step may
  already have run). Here a thread waits on each step's outputs as soon as they are
  dispatched and stamps the time they become ready; a step's time is the gap between
  consecutive completions. The first step of a run has none: it includes compiling.
  """

  def __init__(self, clock=time.perf_counter):
    self._clock = clock
    self._pending = queue.Queue()
    self._finished: dict[int, float] = {}
    self._paused: set[int] = set()  # steps followed by other work (an evaluation)
    self._ready = threading.Condition()
    self._thread = threading.Thread(target=self._wait_for_steps, daemon=True)
    self._thread.start()

  def _wait_for_steps(self):
    while (item := self._pending.get()) is not None:
      step, outputs = item
      try:
        jax.block_until_ready(outputs)
      except Exception:  # noqa: BLE001  the loop's own read of these outputs reports the error
        pass
      with self._ready:
        self._finished[step] = self._clock()
        self._ready.notify_all()

  def watch(self, step: int, outputs):
    self._pending.put((step, outputs))

  def pause_after(self, step: int):
    """Other work ran between `step` and the next one: the next one has no step time."""
    self._paused.add(step)

  def step_time(self, step: int) -> float | None:
    """Seconds between step-1 and `step` finishing (blocks until `step` has); None when
    step-1 was not watched or other work ran after it."""
    with self._ready:
      self._ready.wait_for(lambda: step in self._finished)
      previous = None if step - 1 in self._paused else self._finished.get(step - 1)
      return None if previous is None else self._finished[step] - previous

  def close(self):
    self._pending.put(None)
    self._thread.join()
