"""Fine-tuning cost: full fine-tuning against LoRA against QLoRA (int8, int4), and the
compiled per-chip HBM of LoRA on llama3-8b for a TPU slice (compile-only).

    JAX_PLATFORMS=cpu python benchmarks/finetune.py [--steps 5] [--rank 16] [--topology v5e-8] [--no-tpu]

CPU (bench-20m on 1 device, float32, the bundled corpus): seconds per step after two warm-up
steps, tokens/s, the train state's bytes (trained params + optimizer state + the frozen base)
and the compiled step's temporaries from memory_analysis(). LoRA targets every projection at
--rank, over the random-init base (model.lora.base unset); QLoRA quantizes that base as it
loads (int4: group 64).
TPU: llama3-8b (bf16 weights) with LoRA at --rank on --topology, at the config's batch and
length, compiled through libtpu with the same train step; per-chip HBM from
memory_analysis(), against full fine-tuning of the same config.
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

_MiB, _GiB = 1 << 20, 1 << 30


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def cpu_row(name: str, overrides: list[str], steps: int) -> dict:
  config = load_config("bench-20m", ["mesh.fsdp=1", "checkpoint.enabled=false", *overrides])
  trainer = Trainer(config, devices=jax.devices()[:1])
  state = trainer.init_state()
  batches = trainer.batches()
  data = [next(batches) for _ in range(steps + 2)]
  for batch in data[:2]:
    state, metrics = trainer.step(state, batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for batch in data[2:]:
    state, metrics = trainer.step(state, batch)
  jax.block_until_ready((state, metrics))
  step_s = (time.perf_counter() - start) / steps
  with trainer.context():
    compiled = trainer.train_step.lower(trainer.abstract_state(), data[0]).compile()
  tokens = config.data.global_batch_size * config.data.seq_len
  return {"name": name, "step_s": step_s, "tokens_per_s": tokens / step_s, "trained": _bytes(state.params),
          "opt": _bytes(state.opt_state), "frozen": _bytes(state.frozen),
          "temp": compiled.memory_analysis().temp_size_in_bytes, "loss": float(metrics["loss"])}


def tpu_row(topology: str, name: str, overrides: list[str]) -> dict:
  from jaxpar.aot.compile import compile_for_topology
  config = load_config("llama3-8b", ["model.param_dtype=bfloat16", f"mesh.topology={topology}",
                                     "data.global_batch_size=8", "data.seq_len=4096", *overrides])
  report, _ = compile_for_topology(config, topology)
  return {"name": name, "fits": report["fits"], "hbm": report.get("memory", {}).get("total"),
          "opt": report["state_bytes"]["opt_state"], "trained": report["state_bytes"]["params"],
          "compile_s": report["compile_s"], "oom": report["oom"]}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--topology", default="v5e-8")
  parser.add_argument("--no-tpu", action="store_true")
  parser.add_argument("--tpu-only", action="store_true")
  parser.add_argument("--no-full", action="store_true", help="TPU: LoRA only (full fine-tuning takes as long again)")
  args = parser.parse_args()
  lora = [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}"]
  if not args.tpu_only:
    cpu_table(args, lora)
  if args.no_tpu:
    return
  print(f"\nllama3-8b (bf16 weights), {args.topology}, 8 x 4096 tokens, compile-only: per chip", flush=True)
  print("| run | fits | HBM GiB | trained GiB | optimizer GiB | compile s |")
  print("| --- | --- | --- | --- | --- | --- |", flush=True)
  runs = [(f"LoRA r{args.rank}", lora)] + ([] if args.no_full else [("full fine-tuning", [])])
  for name, overrides in runs:
    r = tpu_row(args.topology, name, overrides)
    hbm = f"{r['hbm'] / _GiB:.2f}" if r["hbm"] else f"DOES NOT FIT ({r['oom']})"
    print(f"| {r['name']} | {r['fits']} | {hbm} | {r['trained'] / _GiB:.3f} | {r['opt'] / _GiB:.3f} | "
          f"{r['compile_s']:.0f} |", flush=True)


def cpu_table(args, lora):
  rows = [cpu_row("full fine-tuning", [], args.steps),
          cpu_row(f"LoRA r{args.rank}", lora, args.steps),
          cpu_row(f"QLoRA int8 r{args.rank}", [*lora, "model.quantization.mode=int8"], args.steps),
          cpu_row(f"QLoRA int4 r{args.rank}", [*lora, "model.quantization.mode=int4",
                                              "model.quantization.group_size=64"], args.steps)]
  print(f"\nbench-20m, 1 CPU device, float32, {args.steps} timed steps")
  print("| run | s/step | tokens/s | trained MiB | optimizer MiB | frozen base MiB | step temporaries MiB |")
  print("| --- | --- | --- | --- | --- | --- | --- |")
  for r in rows:
    print(f"| {r['name']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['trained'] / _MiB:.1f} | "
          f"{r['opt'] / _MiB:.1f} | {r['frozen'] / _MiB:.1f} | {r['temp'] / _MiB:.1f} |")


if __name__ == "__main__":
  main()
