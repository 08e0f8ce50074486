"""The `jaxpar` command line: a thin layer over the Python API."""

import argparse
import glob
import logging
import os
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
    speed = (f"{s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}%" if "tokens_per_s" in s
             else "too few steps to time")
    console.print(f"[bold]done[/bold]: loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} in "
                  f"{s['wall_s']:.0f} s; {speed}; metrics in {config.train.run_dir}/metrics.jsonl")
  else:
    console.print(f"[bold]done[/bold]: already at step {int(result.state.step)} of "
                  f"train.steps={config.train.steps}; raise train.steps to train on")
  if s["stopped_by"]:
    console.print(f"[bold]stopped[/bold] by {s['stopped_by']} at step {int(result.state.step)}: "
                  f"checkpoint saved in {s['checkpoint']}; run the same command to resume")
    return
  if "checkpoint" in s:
    console.print(f"checkpoint: {s['checkpoint']}")
  if config.train.sample_tokens:
    with trainer.context():
      text = greedy_sample(trainer.graphdef, result.state.params, tokenizer,
                           config.train.sample_prompt, config.train.sample_tokens,
                           config.model.max_seq_len, result.state.model_state)
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


def _compile_on_this_host():
  """TPU topology compiles run on the CPU backend: never try to open a TPU (or GPU) here."""
  import jax
  jax.config.update("jax_platforms", jax.config.jax_platforms or "cpu")


def _cmd_compile(ns):
  _compile_on_this_host()
  from jaxpar.aot.compile import compile_for_topology, save
  from jaxpar.aot.report import format_report
  from jaxpar.config import load_config
  path, overrides = _split_args(ns.args)
  config = load_config(path, overrides)
  topology = ns.topology or config.mesh.topology
  if topology is None:
    raise ValueError("no TPU topology: pass --topology (e.g. v6e-256) or set mesh.topology")
  report, compiled = compile_for_topology(config, topology, ns.num_slices)
  console.print(format_report(report), markup=False, highlight=False)
  if ns.save:
    console.print(f"saved to {save(ns.save, report, compiled)}")


def _cmd_plan(ns):
  if ns.topology:
    _compile_on_this_host()
  from jaxpar.aot.plan import run_plan
  from jaxpar.config import load_config
  path, overrides = _split_args(ns.args)
  run_plan(load_config(path, overrides), topology=ns.topology, top=ns.top, measure=ns.measure,
           output=ns.output, echo=lambda text: console.print(text, markup=False, highlight=False))


def _skip_absent_accelerators():
  """The `tpu` extra installs libtpu so that CPU hosts can compile for TPU pods. Left alone,
  JAX then initialises libtpu at start-up even with no TPU attached, which prints alarming
  warnings before anything else. A host with no TPU or GPU device files uses the CPU
  backend directly; on a TPU VM (or with JAX_PLATFORMS set) nothing changes."""
  if "JAX_PLATFORMS" in os.environ:
    return
  devices = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")
  if not any(glob.glob(pattern) for pattern in devices):
    os.environ["JAX_PLATFORMS"] = "cpu"


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

  compile_ = commands.add_parser(
      "compile", help="compile the train step for a TPU topology (no TPU needed)",
      description="Compile CONFIG's train step for a TPU slice on this host (libtpu, "
      "JAX_PLATFORMS=cpu): per-device memory against HBM, FITS / DOES NOT FIT, estimated step "
      "time and MFU, collectives. Prefill/decode steps: not yet (no inference engine).")
  compile_.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  compile_.add_argument("--topology", help="TPU slice, e.g. v6e-256 or v5p:4x4x4 "
                        "(default: the config's mesh.topology)")
  compile_.add_argument("--num-slices", type=int,
                        help="slices joined over DCN, the mesh's dcn_axis spanning them "
                        "(default: mesh.num_slices)")
  compile_.add_argument("--save", metavar="DIR", help="write report.json, the serialized "
                        "executable train_step.exe and its HLO here")
  compile_.set_defaults(func=_cmd_compile)

  plan = commands.add_parser(
      "plan", help="rank mesh / remat / microbatch choices, compile-verified",
      description="Enumerate data x fsdp x tensor meshes, remat policies and microbatch "
      "counts for CONFIG; prune with an analytic model; compile the best K; write the winner "
      "as a config you can pass to `jaxpar train`.")
  plan.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  plan.add_argument("--topology", help="TPU slice (e.g. v5p-128); default: this host's devices")
  plan.add_argument("--top", type=int, default=3, help="candidates to compile (default 3)")
  plan.add_argument("--measure", action="store_true",
                    help="also run the compiled candidates here (local devices only) and report "
                    "the rank correlation of predicted and measured step times")
  plan.add_argument("--output", default="plan.yaml", help="where to write the winning config")
  plan.set_defaults(func=_cmd_plan)

  config = commands.add_parser("config", help="inspect configs")
  config_commands = config.add_subparsers(dest="config_command", required=True)
  show = config_commands.add_parser("show", help="print the resolved config",
                                    description="Print CONFIG with overrides applied and validated.")
  show.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  show.set_defaults(func=_cmd_config_show)
  return parser


def _parse(parser, argv):
  """Options may come anywhere, also after `key=value` overrides: what argparse leaves over
  joins the command's overrides, and an unknown option is still an error."""
  ns, extra = parser.parse_known_args(argv)
  unknown = [a for a in extra if a.startswith("-") or not hasattr(ns, "args")]
  if unknown:
    parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  if extra:
    ns.args = ns.args + extra
  return ns


def main(argv=None) -> int:
  parser = build_parser()
  ns = _parse(parser, argv)
  _skip_absent_accelerators()
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
