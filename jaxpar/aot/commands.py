"""`jaxpar compile` and `jaxpar plan`: compile for a TPU slice on this host (no TPU needed)
and rank parallel layouts by compiling them (jaxpar/aot/)."""

import importlib.util

from rich.console import Console

from jaxpar.cluster import distributed
from jaxpar.errors import UserError

console = Console(soft_wrap=True)


def _compile_on_this_host():
  """`compile` and `plan --topology` compile for a TPU slice on the CPU backend: never open
  this host's own TPU (or GPU), which a training job may hold. Without libtpu they say so
  at once, before JAX or the config load."""
  if importlib.util.find_spec("libtpu") is None:
    raise UserError("compiling for a TPU slice needs libtpu on this host: pip install 'jaxpar[tpu]'")
  import jax

  from jaxpar.host import prepare_topology_compile
  jax.config.update("jax_platforms", jax.config.jax_platforms or "cpu")
  prepare_topology_compile()


def _cmd_compile(ns):
  _compile_on_this_host()
  from jaxpar.aot.compile import compile_for_topology, save
  from jaxpar.aot.phases import Phases
  from jaxpar.aot.report import format_report
  from jaxpar.config import load_config_args
  config = load_config_args(ns.args)
  topology = ns.topology or config.mesh.topology
  if topology is None:
    raise UserError("no TPU topology: pass --topology (e.g. v6e-256) or set mesh.topology")
  if ns.inference:
    from jaxpar.aot.inference import compile_inference, format_inference_report
    report = compile_inference(config, topology, slots=ns.slots, context=ns.context, page_size=ns.page_size,
                               chunk=ns.prefill_chunk, num_slices=ns.num_slices or 1, phase=Phases(console))
    console.print(format_inference_report(report), markup=False, highlight=False)
    return
  report, compiled = compile_for_topology(config, topology, ns.num_slices, phase=Phases(console))
  console.print(format_report(report), markup=False, highlight=False)
  if config.train.objective == "grpo" and report["num_slices"] > 1:
    console.print("the collocated rollout sizing covers one slice: run without --num-slices for it")
  elif config.train.objective == "grpo":  # the rollout engine shares the chips
    from jaxpar.aot.rl_plan import format_rollout_plan, plan_rollouts
    plan = plan_rollouts(config, topology, phase=Phases(console), trained=(report, compiled))
    console.print(format_rollout_plan(plan), markup=False, highlight=False)
  if ns.save:
    console.print(f"saved to {save(ns.save, report, compiled)}")


def _cmd_plan(ns):
  if ns.serve and not ns.topology:
    raise UserError("plan --serve sizes serving for a TPU slice: add --topology (e.g. v6e-8)")
  if (ns.prompt_tokens or ns.itl_slo) and not ns.output_tokens:
    raise UserError("--prompt-tokens and --itl-slo describe a workload: add --output-tokens N (its completions' "
                    "length)")
  if ns.serve and ns.precisions:
    raise UserError("--precisions ranks training precisions: drop it with --serve (the KV cache's dtype is "
                    "ranked already)")
  if ns.topology:
    _compile_on_this_host()
  from jaxpar.aot.phases import Phases
  from jaxpar.aot.plan import run_plan
  from jaxpar.config import load_config_args
  if ns.serve:
    from jaxpar.aot.serve_plan import Workload, run_serve_plan
    workload = None
    if ns.output_tokens:
      workload = Workload(ns.prompt_tokens or ns.context // 2, ns.output_tokens,
                          ns.itl_slo / 1e3 if ns.itl_slo else None)
    run_serve_plan(load_config_args(ns.args), ns.topology, context=ns.context, max_slots=ns.max_slots,
                   page_size=ns.page_size, top=ns.top, output=ns.output or "serve-plan.yaml",
                   echo=lambda text: console.print(text, markup=False, highlight=False), phase=Phases(console),
                   workload=workload)
    return
  run_plan(load_config_args(ns.args), topology=ns.topology, top=ns.top, measure=ns.measure,
           output=ns.output or "plan.yaml", echo=lambda text: console.print(text, markup=False, highlight=False),
           phase=Phases(console), num_slices=ns.num_slices,
           precisions=tuple(p for p in (ns.precisions or "").split(",") if p))


def add_parsers(commands):
  compile_ = commands.add_parser(
      "compile", help="compile the train step for a TPU topology (no TPU needed)",
      description="Compile CONFIG's train step for a TPU slice on this host (libtpu, "
      "JAX_PLATFORMS=cpu): per-device memory against HBM, FITS / DOES NOT FIT, estimated step "
      "time and MFU, collectives. With --inference: the decode step and a prefill chunk with a KV cache.")
  compile_.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  compile_.add_argument("--topology", help="TPU slice, e.g. v6e-256 or v5p:4x4x4 "
                        "(default: the config's mesh.topology)")
  compile_.add_argument("--num-slices", type=int,
                        help="slices joined over DCN, the mesh's dcn_axis spanning them "
                        "(default: mesh.num_slices)")
  compile_.add_argument("--save", metavar="DIR", help="write report.json, the serialized "
                        "executable train_step.exe and its HLO here")
  distributed.add_distributed_args(compile_)
  inference = compile_.add_argument_group("generation programs (--inference)")
  inference.add_argument("--inference", action="store_true",
                         help="compile the decode step and a prefill chunk instead of the train step, "
                         "with bf16 weights and a paged KV cache")
  inference.add_argument("--slots", type=int, default=32, help="sequences decoded together (default 32)")
  inference.add_argument("--context", type=int, default=8192, help="tokens cached per sequence (default 8192)")
  inference.add_argument("--page-size", type=int, default=128, help="KV cache page size (default 128)")
  inference.add_argument("--prefill-chunk", type=int, default=512, help="prefill chunk length (default 512)")
  compile_.set_defaults(func=_cmd_compile)

  plan = commands.add_parser(
      "plan", help="rank mesh / remat / microbatch choices, compile-verified",
      description="Enumerate data x stage x fsdp x context x expert x tensor meshes (with pipeline "
      "microbatches, repeats and schedule), remat policies and microbatch counts for CONFIG; prune with an analytic model; compile the best K; write the winner "
      "as a config you can pass to `jaxpar train`.")
  plan.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE ...]")
  plan.add_argument("--topology", help="TPU slice (e.g. v5p-128); default: this host's devices")
  plan.add_argument("--num-slices", type=int, default=1, help="slices of --topology joined over DCN "
                    "(each layout then names the axis spanning them: stage, data or fsdp)")
  plan.add_argument("--top", type=int, default=3, help="candidates to compile (default 3)")
  plan.add_argument("--precisions", metavar="P[,P...]",
                    help="also try each layout at these model.train_precision values (e.g. int8): int8 "
                    "matmuls count at the chip's int8 peak; never chosen unless listed")
  plan.add_argument("--measure", action="store_true",
                    help="also run the compiled candidates here (local devices only) and report "
                    "the rank correlation of predicted and measured step times")
  plan.add_argument("--output", help="where to write the winner (default plan.yaml; --serve: serve-plan.yaml)")
  serving = plan.add_argument_group("serving (--serve)")
  serving.add_argument("--serve", action="store_true",
                       help="plan serving instead of training: replicas x tensor x expert x data meshes and "
                       "KV cache dtypes, sized by their bytes, ranked by a roofline estimate of decode tokens/s, "
                       "the best --top compiled for --topology; writes the winner's `jaxpar serve` command")
  serving.add_argument("--context", type=int, default=8192, help="tokens per sequence to size for (default 8192)")
  serving.add_argument("--max-slots", type=int, default=256, help="most sequences one replica decodes (default 256)")
  serving.add_argument("--page-size", type=int, default=128, help="KV cache page size (default 128)")
  serving.add_argument("--output-tokens", type=int, metavar="N",
                       help="a workload: completions of N tokens; candidates then include disaggregated prefill "
                       "and decode and rank by the tokens/s served while every prompt is prefilled")
  serving.add_argument("--prompt-tokens", type=int, metavar="N", help="the workload's prompts (default --context / 2)")
  serving.add_argument("--itl-slo", type=float, metavar="MS",
                       help="the workload's bound on inter-token latency: candidates within it rank first")
  plan.set_defaults(func=_cmd_plan)
