"""The `jaxpar` command line: a thin layer over the Python API."""

import argparse
import logging
import sys

from rich.console import Console

console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)


def _split_args(args):
  """`[CONFIG] [key=value ...]` -> (config or None, overrides)."""
  config = args[0] if args and "=" not in args[0] else None
  return config, args[1 if config else 0:]


def _cmd_config_show(ns):
  from jaxpar.config import load_config, to_yaml
  path, overrides = _split_args(ns.args)
  console.print(to_yaml(load_config(path, overrides)), end="", markup=False, highlight=False)


def _cmd_train(ns):
  from jaxpar.config import load_config
  from jaxpar.sample import greedy_sample
  from jaxpar.trainer import Trainer
  path, overrides = _split_args(ns.args)
  config = load_config(path, overrides)
  trainer = Trainer(config)
  console.print(f"[bold]jaxpar train[/bold]: {trainer.num_params:,} parameters, mesh "
                f"{dict((k, v) for k, v in trainer.mesh.shape.items() if v > 1) or 'single device'}, "
                f"{config.train.steps} steps of {config.data.global_batch_size} x {config.data.seq_len} tokens")
  tokenizer = trainer.tokenizer()
  result = trainer.fit(batches=trainer.batches(tokenizer), show_progress=not ns.no_progress,
                       restore=ns.restore)
  s = result.summary
  if s["steps"]:
    console.print(f"[bold]done[/bold]: loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} in "
                  f"{s['wall_s']:.0f} s; {s.get('tokens_per_s', 0):,.0f} tokens/s, "
                  f"MFU {100 * s.get('mfu', 0):.1f}%; metrics in {config.train.run_dir}/metrics.jsonl")
  else:
    console.print(f"[bold]done[/bold]: already at step {int(result.state['step'])} of "
                  f"train.steps={config.train.steps}; raise train.steps to train on")
  if s["stopped_by"]:
    console.print(f"[bold]stopped[/bold] by {s['stopped_by']} at step {int(result.state['step'])}: "
                  f"checkpoint saved in {s['checkpoint']}; run the same command to resume")
    return
  if "checkpoint" in s:
    console.print(f"checkpoint: {s['checkpoint']}")
  if config.train.sample_tokens:
    with trainer.context():
      text = greedy_sample(trainer.graphdef, result.state["params"], tokenizer,
                           config.train.sample_prompt, config.train.sample_tokens,
                           config.model.max_seq_len)
    console.print("[bold]sample[/bold] (greedy):", markup=True)
    console.print(config.train.sample_prompt + text, markup=False, highlight=False)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxpar", description="Train and serve LLMs on device meshes.")
  parser.add_argument("--debug", action="store_true", help="show full tracebacks")
  commands = parser.add_subparsers(dest="command", required=True)

  train = commands.add_parser("train", help="train a model from a config",
                              description="Train from CONFIG (a YAML path or a shipped name; "
                              "default: tiny) with dotted overrides, e.g. model.num_layers=4 mesh.fsdp=8.")
  train.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  train.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
  train.add_argument("--restore", metavar="PATH",
                     help="start from this checkpoint (a checkpoint dir: its latest step; or one "
                     "step dir) instead of the run dir's latest")
  train.set_defaults(func=_cmd_train)

  config = commands.add_parser("config", help="inspect configs")
  config_commands = config.add_subparsers(dest="config_command", required=True)
  show = config_commands.add_parser("show", help="print the resolved config",
                                    description="Print CONFIG with overrides applied and validated.")
  show.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  show.set_defaults(func=_cmd_config_show)
  return parser


def main(argv=None) -> int:
  parser = build_parser()
  ns = parser.parse_args(argv)
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
  try:
    ns.func(ns)
  except (ValueError, FileNotFoundError) as e:
    if ns.debug:
      raise
    errors.print(f"[bold red]error:[/bold red] {e}", markup=True, highlight=False)
    return 2
  except KeyboardInterrupt:
    console.print("interrupted")
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
