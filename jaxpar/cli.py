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


def _cmd_convert_hf_to_jaxpar(ns):
  from jaxpar.hf import hf_to_jaxpar
  config = hf_to_jaxpar(ns.hf_dir, ns.out)
  m = config.model
  console.print(f"[bold]converted[/bold] {ns.hf_dir} -> {ns.out} (step 0, parameters only): "
                f"{m.num_layers} layers, embed {m.embed_dim}, vocab {m.vocab_size}; fine-tune with "
                f"`jaxpar train CONFIG --restore {ns.out}` where CONFIG has this model section:")
  console.print(_model_yaml(config), end="", markup=False, highlight=False)


def _model_yaml(config) -> str:
  import yaml
  return yaml.safe_dump({"model": config.model.model_dump(mode="json")}, sort_keys=False)


def _cmd_convert_jaxpar_to_hf(ns):
  from jaxpar.hf import jaxpar_to_hf
  out = jaxpar_to_hf(ns.ckpt, ns.out, dtype=ns.dtype)
  console.print(f"[bold]converted[/bold] {ns.ckpt} -> {out}: load it with "
                f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")


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

  convert = commands.add_parser("convert", help="convert Hugging Face <-> jaxpar checkpoints")
  convert_commands = convert.add_subparsers(dest="convert_command", required=True)
  to_jaxpar = convert_commands.add_parser(
      "hf-to-jaxpar", help="HF model dir -> params-only jaxpar checkpoint",
      description="Import a Llama 2/3, Mistral, Qwen2/2.5 or Qwen3 directory (config.json + safetensors).")
  to_jaxpar.add_argument("hf_dir", metavar="HF_DIR")
  to_jaxpar.add_argument("out", metavar="OUT")
  to_jaxpar.set_defaults(func=_cmd_convert_hf_to_jaxpar)
  to_hf = convert_commands.add_parser(
      "jaxpar-to-hf", help="jaxpar checkpoint -> HF model dir",
      description="Export CKPT (a checkpoint dir: its latest step; or one step dir) for transformers.")
  to_hf.add_argument("ckpt", metavar="CKPT")
  to_hf.add_argument("out", metavar="OUT")
  to_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                     help="tensor dtype on disk (default: the model's param_dtype)")
  to_hf.set_defaults(func=_cmd_convert_jaxpar_to_hf)

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
