"""A/B: the same speed probes in two checkouts, rounds alternating A and B in one run.

    python benchmarks/ab.py --a /path/to/old/checkout --b . [--rounds 3]

Each checkout runs the probes with its own `.venv` (so two versions of jaxpar can be compared
even across a package reorganisation); alternating rounds spread a busy host's drift over
both. Probes (bench-20m, random weights, 1 CPU device unless named): train step time at the
config's batch and on 8 simulated devices (fsdp8, batch x8), through the checkout's
`benchmarks/train_throughput.py`; engine decode tokens/s at batch 1, 8 and 32 (prompt 64,
64 new tokens, greedy), through its `benchmarks/decode.py`. Prints the median and the best of each
timing per side and B/A (on a busy host contention only adds time, so the best is the
steadier estimate), and the compiled programs' statistics, which no load can move: XLA's
FLOP and byte counts and the temporary memory of the train step (1 device) and of the
decode step (batch 32).
"""

import argparse
import json
import statistics
import subprocess
from pathlib import Path

PROBE = r"""
import json, os, sys
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, "benchmarks")
import jax, numpy as np
import decode, train_throughput
from jaxpar.config import load_config
try:
  from jaxpar.train.trainer import Trainer
except ImportError:  # before the package was grouped by wing
  from jaxpar.trainer import Trainer
def stats(executable, label):
  cost = executable.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  memory = executable.memory_analysis()
  out[f"{label} GFLOP"] = cost.get("flops", 0) / 1e9
  out[f"{label} GB accessed"] = cost.get("bytes accessed", 0) / 1e9
  out[f"{label} temp MB"] = memory.temp_size_in_bytes / 1e6
out = {}
for name, devices, mesh, mult in (("train ms, 1 device", 1, ["mesh.fsdp=1"], 1),
                                  ("train ms, fsdp8 batch x8", 8, ["mesh.fsdp=8"], 8)):
  base = load_config("bench-20m")
  config = load_config("bench-20m", mesh + [f"data.global_batch_size={base.data.global_batch_size * mult}"])
  trainer = Trainer(config, devices=jax.devices()[:devices])
  out[name] = 1e3 * train_throughput.time_steps(trainer, 5)
  if devices == 1:
    state = trainer.init_state()
    stats(trainer.train_step.lower(state, next(trainer.batches())).compile(), "train step")
model = load_config("bench-20m").model
for batch in (1, 8, 32):
  prompts = np.random.default_rng(batch).integers(0, 256, (batch, 64)).tolist()
  first, full = decode.jaxpar_times(model, batch, prompts, 64, 2)
  out[f"decode tok/s, batch {batch}"] = batch * 63 / (full - first)
engine = decode.engine_for(model, 32, 64, 64)
engine.generate(np.zeros((32, 64), int).tolist(), decode.SamplingParams(max_tokens=2, stop_token_ids=()))
stats(next(e for (kind, b, length, *_), e in engine.programs.compiled.items() if kind == "step" and b == 32 and length == 1),
      "decode step")
print("AB " + json.dumps(out))
"""


def run_probe(checkout: Path) -> dict:
  python = checkout / ".venv" / "bin" / "python"
  done = subprocess.run([str(python), "-c", PROBE], cwd=checkout, capture_output=True, text=True, check=True)
  line = next(l for l in done.stdout.splitlines() if l.startswith("AB "))
  return json.loads(line[3:])


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--a", type=Path, required=True, help="checkout A (with its own .venv)")
  parser.add_argument("--b", type=Path, default=Path("."), help="checkout B (default: this one)")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  results = {"A": [], "B": []}
  for round_ in range(args.rounds):
    for side, checkout in (("A", args.a), ("B", args.b)) if round_ % 2 == 0 else (("B", args.b), ("A", args.a)):
      results[side].append(run_probe(checkout.resolve()))
      print(f"round {round_ + 1} {side}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[side][-1].items()),
            flush=True)
  print(f"\nmedians over {args.rounds} rounds (A: {args.a}, B: {args.b})")
  print(f"{'probe':<28} {'A median':>10} {'B median':>10} {'B/A':>6} {'A best':>10} {'B best':>10} {'B/A':>6}")
  for key in results["A"][0]:
    a, b = ([r[key] for r in results[side]] for side in "AB")
    if "ms" in key or "tok/s" in key:
      best = min if "ms" in key else max
      print(f"{key:<28} {statistics.median(a):>10.1f} {statistics.median(b):>10.1f} "
            f"{statistics.median(b) / statistics.median(a):>6.3f} {best(a):>10.1f} {best(b):>10.1f} {best(b) / best(a):>6.3f}")
    else:  # compiled statistics: the same every round
      print(f"{key:<28} {a[0]:>10.3f} {b[0]:>10.3f} {b[0] / a[0] if a[0] else float('nan'):>6.3f}")


if __name__ == "__main__":
  main()
