"""Long context on 8 simulated CPU devices: how far context parallelism stretches a
sequence, what it communicates and how fast it runs. Model: configs/tiny-long.yaml.

    python benchmarks/long_context.py [--budget-mib 256] [--speed-len 32768] [--skip ...]

fit    For context = 1, 2, 4, 8 (that many devices, batch 1) and each strategy: the
       longest sequence whose compiled train step fits a per-device budget, from
       compiled.memory_analysis() (arguments + outputs - aliased + temporaries): doubling
       from 1024 tokens (from the previous context's answer after the first), then
       bisection until the gap is at most 1/8 of the answer. Compile-only.
comm   Collective bytes per layer and device from the compiled HLO (loop trips counted):
       the step with 2 layers minus the step with 1, at --comm-len tokens, context 8.
speed  Tokens/s of the train step at --speed-len tokens: context 8 (8 devices) for both
       strategies, and context 1 on one device (the same global batch). Best of 2 timed
       steps after 2 warm-up steps. Simulated devices share the host's cores, so this is
       the cost of splitting, not a speed-up.
work   Per-device causal attention tiles (what the kernels compute and do not skip) at
       --speed-len, zig-zag vs contiguous order.
sp     Megatron sequence parallelism off vs on: compiled temporaries per device (the
       activations kept for the backward) of a 2-layer, 4096-token bf16 model on fsdp 4 x
       tensor 2, on 8 simulated CPU devices and, with libtpu, on a TPU v5e-8 (compile-only).
tpu    With libtpu: `jaxpar compile` of Llama 3.1 8B, full depth, 4 x 131,072 tokens on a
       v5p-64 slice (context 8 x fsdp 4) for both strategies: fit verdict, HBM per chip,
       collective bytes (compile-only; the step time is the roofline's estimate).
"""

import argparse
import importlib.util
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxpar.aot import hlo  # noqa: E402
from jaxpar.aot.chips import topology_devices  # noqa: E402
from jaxpar.aot.compile import compile_for_topology, compile_step  # noqa: E402
from jaxpar.aot.report import format_report  # noqa: E402
from jaxpar.config import load_config  # noqa: E402
from jaxpar.pallas_kernels.attention.layout import SequenceSplit  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

STRATEGIES = ("ring", "all_gather")
_MiB = 1 << 20


def _trainer(context, strategy, length, *extra):
  overrides = [f"mesh.context={context}", "mesh.fsdp=1", f"parallel.context.attention={strategy}",
               f"data.seq_len={length}", f"model.max_seq_len={max(length, 1024)}",
               "checkpoint.enabled=false", *extra]
  return Trainer(load_config("tiny-long", overrides), devices=jax.devices()[:context])


def _bytes(context, strategy, length):
  compiled, _ = compile_step(_trainer(context, strategy, length))
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def longest_fit(context, strategy, budget, start=1024):
  """(longest length that fits, its bytes): doubling from `start`, then bisection."""
  unit, best = 2 * context, (0, 0)
  length = max(start // unit * unit, unit)
  while (used := _bytes(context, strategy, length)) <= budget:
    best, length = (length, used), length * 2
  low, high = best[0], length
  while high - low > max(best[0] // 8, unit):
    middle = (low + high) // 2 // unit * unit
    used = _bytes(context, strategy, middle)
    low, high, best = (middle, high, (middle, used)) if used <= budget else (low, middle, best)
  return best


def fit_table(budget_mib):
  print(f"longest sequence whose train step fits {budget_mib} MiB per device (compile-only)")
  print(f"{'context':>7} {'strategy':<10} {'tokens':>8} {'MiB':>7} {'x context=1':>11}")
  first = {}
  for strategy in STRATEGIES:
    length = 1024
    for context in (1, 2, 4, 8):
      length, used = longest_fit(context, strategy, budget_mib * _MiB, start=length)
      first.setdefault(strategy, length)
      print(f"{context:>7} {strategy:<10} {length:>8} {used / _MiB:>7.1f} "
            f"{length / first[strategy]:>10.2f}x", flush=True)
  print()


def _collective_bytes(length, strategy, layers):
  trainer = _trainer(8, strategy, length, f"model.num_layers={layers}")
  compiled, _ = compile_step(trainer)
  return {row["kind"]: row["bytes"] for row in hlo.summarize(hlo.collectives(compiled.as_text()))}


def comm_table(length):
  print(f"collective bytes per layer and device, {length} tokens over context 8 "
        "(2-layer step minus 1-layer step)")
  for strategy in STRATEGIES:
    one, two = (_collective_bytes(length, strategy, n) for n in (1, 2))
    per_layer = {k: two.get(k, 0) - one.get(k, 0) for k in sorted(set(one) | set(two))}
    shown = ", ".join(f"{k} {v / _MiB:.2f} MiB" for k, v in per_layer.items() if v)
    print(f"  {strategy:<10} total {sum(per_layer.values()) / _MiB:7.2f} MiB: {shown}", flush=True)
  print()


def _tokens_per_s(trainer):
  state, batches = trainer.init_state(), trainer.batches()
  for _ in range(2):
    state, metrics = trainer.step(state, next(batches))
  jax.block_until_ready(metrics)
  best = float("inf")
  for _ in range(2):
    batch = next(batches)
    start = time.perf_counter()
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready((state, metrics))
    best = min(best, time.perf_counter() - start)
  return trainer.config.data.seq_len / best, best


def speed_table(length):
  print(f"train step at {length} tokens (batch 1)")
  runs = [(8, s) for s in STRATEGIES] + [(1, "ring")]
  for context, strategy in runs:
    label = f"context {context}, {strategy}" if context > 1 else "context 1 (one device)"
    rate, seconds = _tokens_per_s(_trainer(context, strategy, length))
    print(f"  {label:<26} {seconds:8.1f} s/step {rate:9,.0f} tokens/s", flush=True)
  print()


def work_table(length):
  print(f"causal attention tiles per device (128 x 128), {length} tokens over 8 devices")
  for zigzag in (True, False):
    tiles = SequenceSplit(("context",), 8, zigzag).causal_tiles(length, 128)
    print(f"  {'zig-zag' if zigzag else 'contiguous':<11} max/min {max(tiles) / min(tiles):5.2f}  {tiles}")
  print()


def _sp_temp(sequence_parallel, devices):
  model = ["model.embed_dim=512", "model.mlp_dim=2048", "model.num_heads=8", "model.num_kv_heads=2",
           "model.head_dim=64", "model.compute_dtype=bfloat16", "model.num_layers=2",
           "model.max_seq_len=4096", "model.attention=auto", f"parallel.sequence_parallel={sequence_parallel}"]
  config = load_config("tiny-long", model + ["mesh.context=1", "mesh.fsdp=4", "mesh.tensor=2",
                                             "data.seq_len=4096", "data.global_batch_size=8"])
  compiled, _ = compile_step(Trainer(config, devices=devices))
  return compiled.memory_analysis().temp_size_in_bytes


def sp_table():
  print("sequence parallelism: compiled temporaries per device, fsdp 4 x tensor 2, 8 x 4096 tokens")
  targets = [("8 CPU devices", jax.devices()[:8])]
  if importlib.util.find_spec("libtpu"):
    targets.append(("TPU v5e-8", topology_devices("v5e-8")[1]))
  for name, devices in targets:
    off, on = (_sp_temp(sp, devices) for sp in (False, True))
    print(f"  {name:<14} off {off / _MiB:8.1f} MiB   on {on / _MiB:8.1f} MiB   ({on / off:.2f}x)",
          flush=True)
  print()


def tpu_table():
  if not importlib.util.find_spec("libtpu"):
    print("tpu: libtpu not installed (pip install -e '.[tpu]'), skipped\n")
    return
  for strategy in STRATEGIES:
    config = load_config("llama3-8b", ["mesh.context=8", "data.seq_len=131072",
                                       "data.global_batch_size=4",
                                       f"parallel.context.attention={strategy}"])
    print(f"llama3-8b, {strategy}:")
    print(format_report(compile_for_topology(config, "v5p-64")[0]), flush=True)
    print()


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--budget-mib", type=float, default=256)
  parser.add_argument("--comm-len", type=int, default=8192)
  parser.add_argument("--speed-len", type=int, default=32768)
  parser.add_argument("--skip", nargs="*", default=[],
                      choices=["fit", "comm", "speed", "work", "sp", "tpu"])
  args = parser.parse_args()
  if "work" not in args.skip:
    work_table(args.speed_len)
  if "fit" not in args.skip:
    fit_table(args.budget_mib)
  if "comm" not in args.skip:
    comm_table(args.comm_len)
  if "sp" not in args.skip:
    sp_table()
  if "tpu" not in args.skip:
    tpu_table()
  if "speed" not in args.skip:
    speed_table(args.speed_len)


if __name__ == "__main__":
  main()
