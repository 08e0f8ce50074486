"""The `jaxpar` command line: a thin layer over the Python API."""

import argparse
import re
import sys
import traceback

from rich.console import Console
from rich.markup import escape

from jaxpar.cluster import distributed
from jaxpar.errors import ConfigError, UserError, did_you_mean

console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)


def _cmd_config_show(ns):
  from jaxpar.config import load_config_args, to_yaml
  console.print(to_yaml(load_config_args(ns.args)), end="", markup=False, highlight=False)


def _cmd_config_list(_ns):
  from jaxpar.config import config_summary, shipped_configs
  names = sorted(shipped_configs())
  width = max(map(len, names))
  for name in names:
    console.print(f"{name:<{width}}  {config_summary(name)}", markup=False, highlight=False)


def _cmd_train(ns):
  import jax
  from jaxpar.config import load_config_args
  from jaxpar.train.trainer import Trainer
  config = load_config_args(ns.args)
  trainer = Trainer(config)
  processes = f"{jax.process_count()} processes, " if jax.process_count() > 1 else ""
  trained = trainer.trained_params
  share = (f" (trainable {trained:,}, {100 * trained / trainer.num_params:.2f}%)"
           if trained < trainer.num_params else "")
  console.print(f"[bold]jaxpar train[/bold]: {trainer.num_params:,} parameters{share}, {processes}mesh "
                f"{dict((k, v) for k, v in trainer.mesh.shape.items() if v > 1) or 'single device'}, "
                f"{config.train.steps} steps of {config.data.global_batch_size} x {config.data.seq_len} tokens; "
                f"{config.train.optimizer} ({trainer.optimizer_bytes_per_param:.1f} bytes of optimizer state "
                f"per parameter), {config.train.schedule} schedule")
  if trainer.runtime.plan.pipelined:
    console.print(trainer.runtime.plan.describe_pipeline(), markup=False, highlight=False)
  tokenizer = trainer.tokenizer()
  result = trainer.fit(batches=trainer.batches(tokenizer), show_progress=not ns.no_progress,
                       restore=ns.restore, overwrite=ns.overwrite)
  s = result.summary
  if not s["steps"] and not s["stopped_by"]:
    return  # a finished run: the trainer said so, and how to go on
  if s["steps"]:
    speed = (f"{s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}%" if "tokens_per_s" in s
             else "too few steps to time")
    console.print(f"[bold]done[/bold]: loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} in "
                  f"{s['wall_s']:.0f} s; {speed}; metrics in {config.train.run_dir}/metrics.jsonl")
  from jaxpar.train.metrics import summary_lines
  for line in summary_lines(s, config):  # the final eval, what a data mixture drew
    console.print(line, markup=False, highlight=False)
  if s["stopped_by"]:
    saved = (f"checkpoint saved in {s['checkpoint']}; run the same command to resume"
             if "checkpoint" in s else "nothing saved (checkpoint.enabled=false)")
    console.print(f"[bold]stopped[/bold] by {s['stopped_by']} at step "
                  f"{int(result.state.step)}: {saved}")
    return
  if "checkpoint" in s:
    console.print(f"checkpoint: {s['checkpoint']}")
  if config.train.sample_tokens:
    _print_sample(trainer, result.state, tokenizer)


def _print_sample(trainer, state, tokenizer):
  """A short sample from the trained model, through the inference engine."""
  from jaxpar.inference import Engine, SamplingParams
  from jaxpar.runtime import Runtime
  from jaxpar.weights import relayout
  t, runtime = trainer.config.train, trainer.runtime
  params, model_state = state.weights(), state.model_state
  sizes = runtime.plan.generation_sizes()
  if sizes != runtime.plan.sizes:  # generation lays the same devices out its own way
    mesh = trainer.config.mesh.model_copy(update=sizes)
    source = runtime.layer_order()
    runtime = Runtime(trainer.config.model, mesh, runtime.mesh.devices.flat, parallel=trainer.config.parallel)
    params, model_state = relayout((params, model_state), source, runtime.layer_order(),
                                   (runtime.param_shardings, runtime.model_state_shardings))
  try:
    engine = Engine(runtime, params, tokenizer, model_state=model_state, slots=1, prefill_chunks=(64,))
  except ConfigError as e:  # a model the engine cannot serve yet: the run itself is done and saved
    console.print(f"no sample: {e}", markup=False, highlight=False)
    return
  sampling = SamplingParams(max_tokens=t.sample_tokens, temperature=t.sample_temperature,
                            top_p=t.sample_top_p, seed=t.seed)
  text = engine.generate([t.sample_prompt], sampling)[0].text
  console.print(f"[bold]sample[/bold] (temperature {t.sample_temperature}, top-p {t.sample_top_p}, "
                f"seed {t.seed}):", markup=True)
  console.print(t.sample_prompt + text, markup=False, highlight=False)


def _cmd_convert_hf_to_jaxpar(ns):
  from jaxpar.convert.hf import hf_to_jaxpar
  config = hf_to_jaxpar(ns.hf_dir, ns.out, tokenizer=ns.tokenizer)
  m = config.model
  console.print(f"[bold]converted[/bold] {ns.hf_dir} -> {ns.out} (step 0, parameters only): "
                f"{m.num_layers} layers, embed {m.embed_dim}, vocab {m.vocab_size}; fine-tune with "
                f"`jaxpar train CONFIG --restore {ns.out}` where CONFIG has this model section:")
  console.print(_model_yaml(config), end="", markup=False, highlight=False)


def _model_yaml(config) -> str:
  import yaml
  return yaml.safe_dump({"model": config.model.model_dump(mode="json")}, sort_keys=False)


def _cmd_convert_jaxpar_to_hf(ns):
  from jaxpar.convert.hf import jaxpar_to_hf
  out = jaxpar_to_hf(ns.ckpt, ns.out, dtype=ns.dtype)
  console.print(f"[bold]converted[/bold] {ns.ckpt} -> {out}: load it with "
                f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")


def _cmd_convert_medusa_heads(ns):
  from jaxpar.convert.medusa import export_medusa_heads
  out = export_medusa_heads(ns.run, ns.out)
  console.print(f"[bold]exported[/bold] the draft heads of {ns.run} -> {out}/medusa_lm_head.safetensors "
                "(the Medusa project's layout)")


def _cmd_quantize(ns):
  from jaxpar.convert.quantize import quantize_checkpoint
  config, path = quantize_checkpoint(ns.ckpt, ns.out, ns.mode, ns.group_size, zero_point=ns.zero_point,
                                     outlier_channels=ns.outlier_channels)
  q = config.model.quantization
  detail = f", group size {q.group_size}{', zero points' if q.zero_point else ''}" if q.mode == "int4" else ""
  console.print(f"[bold]quantized[/bold] {ns.ckpt} -> {path} ({q.mode}{detail}); its saved config "
                "sets model.quantization, so restoring it builds the quantized model on any mesh")


def _cmd_launch_local(ns) -> int:
  from jaxpar.cluster.launch_local import launch_local
  command = ns.launched or []
  if command and command[0] == "jaxpar":
    command = command[1:]
  if command and command[0] in ns.subcommands:
    command = [sys.executable, "-m", "jaxpar", *command]
  return launch_local(ns.num_processes, command, devices_per_process=ns.devices_per_process,
                      port=ns.port, grace_s=ns.grace,
                      echo=lambda text: console.print(text, markup=False, highlight=False))


class _Parser(argparse.ArgumentParser):
  """Every (sub)command's parser: options are never abbreviated (`--restor` is an error, not
  `--restore`), and a mistyped command or option gets the nearest one suggested."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, allow_abbrev=False, **kwargs)

  def error(self, message):
    if choice := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
      message += did_you_mean(choice[1], re.findall(r"'([^']*)'", choice[2]))
    super().error(message)

  def unknown_options(self, unknown: list[str]):
    """`unrecognized arguments`, from this (sub)command's parser: its usage, its options."""
    options = [name for action in self._actions for name in action.option_strings]
    hints = "".join(did_you_mean(a, options) for a in unknown if a.startswith("-"))
    self.error(f"unrecognized arguments: {' '.join(unknown)}{hints}")


def _version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("jaxpar")
  except PackageNotFoundError:
    return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
  parser = _Parser(prog="jaxpar", description="Train and serve LLMs on device meshes.")
  parser.add_argument("--debug", action="store_true",
                      help="show full tracebacks (may come anywhere on the command line)")
  parser.add_argument("--version", action="version", version=f"jaxpar {_version()}")
  commands = parser.add_subparsers(dest="command", required=True)

  train = commands.add_parser("train", help="train a model from a config",
                              description="Train from CONFIG (a YAML path or a shipped name; "
                              "default: tiny) with dotted overrides, e.g. model.num_layers=4 mesh.fsdp=8.")
  train.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  train.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
  train.add_argument("--restore", metavar="PATH",
                     help="start from this checkpoint (a checkpoint dir: its latest step; or one "
                     "step dir) instead of the run dir's latest")
  train.add_argument("--overwrite", action="store_true",
                     help="replace the saved run in train.run_dir (its checkpoints, metrics.jsonl, "
                     "tensorboard/, trackers.json) instead of resuming it")
  distributed.add_distributed_args(train)
  train.set_defaults(func=_cmd_train)

  convert = commands.add_parser("convert", help="convert Hugging Face <-> jaxpar checkpoints")
  convert_commands = convert.add_subparsers(dest="convert_command", required=True)
  to_jaxpar = convert_commands.add_parser(
      "hf-to-jaxpar", help="HF model dir -> params-only jaxpar checkpoint",
      description="Import a Hugging Face directory (config.json + safetensors) of a model type a registered "
      "family imports (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Mixtral, Qwen3-MoE, DeepSeek-V3, Gemma 2/3, GPT-OSS).")
  to_jaxpar.add_argument("hf_dir", metavar="HF_DIR")
  to_jaxpar.add_argument("out", metavar="OUT")
  to_jaxpar.add_argument("--tokenizer", metavar="PATH",
                         help="the tokenizer, when HF_DIR has no tokenizer.json: a tokenizer.json or a "
                         "directory holding one, or `byte` for jaxpar's byte tokens")
  to_jaxpar.set_defaults(func=_cmd_convert_hf_to_jaxpar)
  to_hf = convert_commands.add_parser(
      "jaxpar-to-hf", help="jaxpar checkpoint -> HF model dir",
      description="Export CKPT (a checkpoint dir: its latest step; or one step dir) for transformers.")
  to_hf.add_argument("ckpt", metavar="CKPT")
  to_hf.add_argument("out", metavar="OUT")
  to_hf.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                     help="tensor dtype on disk (default: the model's param_dtype)")
  to_hf.set_defaults(func=_cmd_convert_jaxpar_to_hf)
  heads = convert_commands.add_parser(
      "medusa-heads", help="a run's Medusa draft heads -> the Medusa project's layout",
      description="Write RUN's draft heads (trained with train.objective=medusa) as medusa_lm_head.safetensors "
      "and config.json in OUT, as the Medusa project (FasterDecoding/Medusa) keeps them beside a base.")
  heads.add_argument("run", metavar="RUN")
  heads.add_argument("out", metavar="OUT")
  heads.set_defaults(func=_cmd_convert_medusa_heads)

  quantize = commands.add_parser(
      "quantize", help="quantize a checkpoint's projection weights (int8, int4, W8A8)",
      description="Write a params-only checkpoint OUT with CKPT's projections quantized: int8 "
      "(W8A16, per-channel scales), int4 (W4A16, per-group scales) or w8a8 (int8 weights and "
      "per-token int8 activations). Its config sets model.quantization.")
  quantize.add_argument("ckpt", metavar="CKPT", help="a checkpoint dir (its latest step) or one step dir")
  quantize.add_argument("out", metavar="OUT", help="a new checkpoint directory")
  quantize.add_argument("--mode", required=True, choices=("int8", "int4", "w8a8"))
  quantize.add_argument("--group-size", type=int, choices=(32, 64, 128),
                        help="int4: rows sharing one scale (default: the widest of 128, 64, 32 that divides the "
                        "model's embed, head and mlp dims)")
  quantize.add_argument("--zero-point", action="store_true", help="int4: asymmetric groups")
  quantize.add_argument("--outlier-channels", type=int, default=0,
                        help="w8a8: keep this many input channels with the largest |x| in float")
  quantize.set_defaults(func=_cmd_quantize)

  from jaxpar.aot.commands import add_parsers as add_aot_parsers
  add_aot_parsers(commands)
  from jaxpar.inference.commands import add_parsers as add_inference_parsers
  add_inference_parsers(commands)
  from jaxpar.plot import add_parser as add_plot_parser
  add_plot_parser(commands)
  from jaxpar.data.commands import add_parsers as add_data_parsers
  add_data_parsers(commands)
  from jaxpar.train.eval_command import add_parsers as add_eval_parsers
  add_eval_parsers(commands)
  from jaxpar.finetune.commands import add_parsers as add_lora_parsers
  add_lora_parsers(commands)
  from jaxpar.check.commands import add_parsers as add_check_parsers
  add_check_parsers(commands)

  launch = commands.add_parser(
      "launch-local", help="run N processes of one job on this machine (simulated CPU devices)",
      description="Run COMMAND (a jaxpar subcommand, or any program calling "
      "jaxpar.cluster.distributed.initialize()) as processes 0..N-1 of one jax.distributed job on this "
      "machine: each with its own simulated CPU devices, gloo collectives, a coordinator on "
      "127.0.0.1. Example: jaxpar launch-local 2 -- train tiny mesh.fsdp=8",
      usage="jaxpar launch-local N [options] -- COMMAND ...")
  launch.add_argument("num_processes", type=int, metavar="N", help="processes to start")
  launch.add_argument("--devices-per-process", type=int, default=4,
                      help="simulated CPU devices in each process (default 4)")
  launch.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
  launch.add_argument("--grace", type=float, default=90.0, metavar="S",
                      help="after one process fails, seconds the others get to stop before they "
                      "are killed (default 90)")
  launch.set_defaults(func=_cmd_launch_local, launched=None)

  config = commands.add_parser("config", help="inspect configs")
  config.set_defaults(func=_cmd_config_list)  # `jaxpar config` alone lists them
  config_commands = config.add_subparsers(dest="config_command")
  config_commands.add_parser("list", help="the shipped configs, one line each").set_defaults(func=_cmd_config_list)
  show = config_commands.add_parser("show", help="print the resolved config",
                                    description="Print CONFIG with overrides applied and validated.")
  show.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  show.set_defaults(func=_cmd_config_show)
  launch.set_defaults(subcommands=set(commands.choices))
  _name_each_parser(parser)
  return parser


def _name_each_parser(parser):
  """Each (sub)command's parser in its parsed namespace (`command_parser`; the deepest one
  wins), so a late error shows that command's usage, not the top level's."""
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for sub in action.choices.values():
        sub.set_defaults(command_parser=sub)
        _name_each_parser(sub)


def _parse(parser, argv):
  """Options may come anywhere, also after `key=value` overrides: what argparse leaves over
  joins the command's overrides, and an unknown option is still an error. For launch-local,
  everything after `--` is the command it launches."""
  argv = list(sys.argv[1:] if argv is None else argv)
  launched = None
  if "launch-local" in argv and "--" in argv[argv.index("launch-local"):]:
    cut = argv.index("--", argv.index("launch-local"))
    argv, launched = argv[:cut], argv[cut + 1:]
  debug = "--debug" in argv  # a global option, accepted after the subcommand too
  ns, extra = parser.parse_known_args([a for a in argv if a != "--debug"])
  ns.debug = debug
  unknown = [a for a in extra if a.startswith("-") or not hasattr(ns, "args")]
  if unknown:
    getattr(ns, "command_parser", parser).unknown_options(unknown)
  if extra:
    ns.args = ns.args + extra
  if launched is not None:
    ns.launched = launched
  return ns


def _run(ns) -> tuple[int, str | None]:
  """(exit code, the one-line failure or None). A user's mistake (UserError, a missing file)
  is one line and exit 2; anything else is a bug of ours: the last frames, a pointer to
  --debug, exit 1."""
  try:
    if hasattr(ns, "coordinator"):  # a subcommand with the multi-process options
      distributed.initialize(distributed.options_from_args(ns))
      console.quiet = not distributed.is_primary()  # one voice: process 0's
    return ns.func(ns) or 0, None
  except KeyboardInterrupt:
    console.print("interrupted")
    return 130, "interrupted"
  except Exception as e:
    if ns.debug:
      raise
    return _report(e)


def _report(error: Exception) -> tuple[int, str]:
  who = escape(distributed.label())
  if isinstance(error, (UserError, FileNotFoundError)):
    errors.print(f"{who}[bold red]error:[/bold red] {escape(str(error))}", markup=True, highlight=False)
    return 2, str(error)
  summary = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
  frames = "".join(traceback.format_list(traceback.extract_tb(error.__traceback__)[-3:]))
  errors.print(f"{escape(frames.rstrip())}\n{who}[bold red]error:[/bold red] {escape(summary)}\n"
               "this is a bug in jaxpar; run again with --debug for the full traceback",
               markup=True, highlight=False)
  return 1, summary


def main(argv=None) -> int:
  parser = build_parser()
  ns = _parse(parser, argv)
  distributed.configure_logging()
  try:
    code, failure = _run(ns)
  except Exception as e:  # --debug: the whole traceback
    if not distributed.is_multiprocess():
      raise
    traceback.print_exc()  # then tell the peers, which would otherwise wait for this process
    code, failure = 1, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  if failure and distributed.is_multiprocess():
    distributed.fail(failure, code)
  return code


if __name__ == "__main__":
  sys.exit(main())
