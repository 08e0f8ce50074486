"""`jaxpar eval RUN_OR_CHECKPOINT [SOURCE...]`: loss, perplexity and bits per byte of a saved
run on its eval sets (or named sources / paths), through the saved-run door; with `--tasks`,
EleutherAI's lm-evaluation-harness in process (jaxpar/train/harness.py)."""

import json

from rich.console import Console

from jaxpar.parallel import parse_mesh_sizes

console = Console(soft_wrap=True)


def _mesh(run, overrides):
  """The mesh the run trained on (so the numbers match training's), or the one `--mesh`
  gives instead (axes it does not name: fsdp the rest, the others 1); FSDP over every device
  when the saved one does not fit the devices here."""
  from jaxpar.config import MeshConfig
  sizes = parse_mesh_sizes(overrides, "--mesh")
  saved = run.config.mesh
  if sizes:
    return MeshConfig(rules=saved.rules, **sizes)
  import jax
  fixed = [size for size in saved.axis_sizes().values() if size != -1]
  needed, rest = 1, len(fixed) < len(saved.axis_sizes())
  for size in fixed:
    needed *= size
  if jax.device_count() % needed if rest else jax.device_count() != needed:
    console.print(f"the run's mesh {saved.axis_sizes()} does not fit the {jax.device_count()} devices here: "
                  "FSDP over all of them (pass --mesh to choose)")
    return MeshConfig(fsdp=-1, rules=saved.rules)
  return saved


def evaluate_saved_run(path, sources=None, *, step=None, mesh=None, steps=None, batch_size=None,
                       progress=None) -> dict:
  """{set: {"loss", "perplexity", "bits_per_byte", "tokens"}} of a saved run (jaxpar.open_run);
  `progress(set name, batches done, batches)` as batches finish."""
  from jaxpar.errors import ConfigError
  from jaxpar.mesh import logical_to_sharding
  from jaxpar.weights import SavedRun
  from jaxpar.train.evaluator import Evaluator
  with SavedRun(path, step) as run:
    if not sources and not run.config.eval_sets():
      raise ConfigError(f"run {run.directory} has no eval sets (eval.sets, data.holdout, weight-0 sources): "
                        "name what to evaluate, e.g. jaxpar eval RUN data/valid.jsonl")
    run.load(_mesh(run, mesh))
    runtime = run.runtime
    batch_sharding = logical_to_sharding(("batch", "length"), None, runtime.mesh, runtime.rules)
    evaluator = Evaluator(run.config, runtime, run.tokenizer, runtime.param_shardings,
                          runtime.model_state_shardings, batch_sharding, names=sources or None, steps=steps,
                          batch_size=batch_size)
    return {"step": run.step, "results": evaluator.run(run.params, run.model_state, progress)}


def _progress_bar():
  """A bar per eval set on stderr, with an ETA (stdout carries only the results)."""
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
  bar = Progress(TextColumn("[bold]eval {task.description}"), BarColumn(), MofNCompleteColumn(),
                 TimeRemainingColumn(), console=Console(stderr=True, soft_wrap=True))
  tasks = {}

  def update(name, done, total):
    if name not in tasks:
      tasks[name] = bar.add_task(name, total=total)
    bar.update(tasks[name], completed=done)
  return bar, update


def _cmd_eval(ns):
  if ns.tasks:
    try:
      from jaxpar.train.harness import run_tasks
    except ModuleNotFoundError as e:
      if not (e.name or "").startswith("lm_eval"):
        raise
      from jaxpar.errors import ConfigError
      raise ConfigError("--tasks runs EleutherAI's lm-evaluation-harness, which is not installed: "
                        "pip install 'jaxpar[eval]'") from None
    results = run_tasks(ns.run, ns.tasks.split(","), step=ns.step, limit=ns.limit, batch_size=ns.batch_size,
                        include_path=ns.include_path, num_fewshot=ns.num_fewshot)
    console.print(results["table"], markup=False, highlight=False)
    if ns.output:
      with open(ns.output, "w") as f:
        json.dump(results["results"], f, indent=1, default=str)
    return
  # `mesh.AXIS=SIZE` among the sources, as generate and serve take it (or --mesh AXIS=SIZE ...).
  mesh = [item for item in ns.sources if item.startswith("mesh.")] + (ns.mesh or [])
  sources = [item for item in ns.sources if not item.startswith("mesh.")]
  bar, progress = _progress_bar()
  with bar:
    out = evaluate_saved_run(ns.run, sources, step=ns.step, mesh=mesh, steps=ns.steps,
                             batch_size=ns.batch_size, progress=progress)
  console.print(f"[bold]eval[/bold] {ns.run} at step {out['step']}:")
  for name, r in out["results"].items():
    console.print(f"  {name}: loss {r['loss']:.4f}  perplexity {r['perplexity']:.3f}  "
                  f"bits/byte {r['bits_per_byte']:.4f}  ({r['tokens']:,.0f} tokens)", markup=False, highlight=False)
  if ns.output:
    with open(ns.output, "w") as f:
      json.dump(out, f, indent=1)


def add_parsers(commands):
  evaluate = commands.add_parser(
      "eval", help="evaluate a saved run: loss, perplexity, bits per byte; or lm-eval tasks",
      description="Evaluate RUN (a run dir, its checkpoints dir or one step dir) on its eval sets, or on "
      "SOURCE...: eval set or data source names of its config, or data paths. At the step training "
      "evaluated, on the same mesh, it gives training's numbers. With --tasks: EleutherAI's "
      "lm-evaluation-harness (pip install 'jaxpar[eval]') in process.")
  evaluate.add_argument("run", metavar="RUN_OR_CHECKPOINT")
  evaluate.add_argument("sources", nargs="*", metavar="SOURCE",
                        help="eval sets, data source names or paths; mesh.AXIS=SIZE items give the mesh")
  evaluate.add_argument("--step", type=int, help="the checkpoint step (default: the latest)")
  evaluate.add_argument("--steps", type=int, help="batches per set (default: eval.steps, else all)")
  evaluate.add_argument("--batch-size", type=int, help="windows (or harness requests) per batch")
  evaluate.add_argument("--mesh", nargs="+", metavar="AXIS=SIZE",
                        help="the mesh to load onto, also given as mesh.AXIS=SIZE items (default: the run's "
                        "own, else FSDP over all devices)")
  evaluate.add_argument("--tasks", help="comma-separated lm-eval task names (runs the harness)")
  evaluate.add_argument("--include-path", help="a folder of extra lm-eval task YAMLs (local tasks)")
  evaluate.add_argument("--num-fewshot", type=int, help="lm-eval few-shot examples")
  evaluate.add_argument("--limit", type=float, help="lm-eval: at most this many items per task")
  evaluate.add_argument("--output", help="also write the results here as JSON")
  evaluate.set_defaults(func=_cmd_eval)
