"""Training across a slow link (train.sync): eval loss against the bytes sent over `data` and
against tokens, for all-reduce, DiLoCo (H = 8, 32, 128), Streaming DiLoCo and SparseLoCo.

    python benchmarks/low_bandwidth.py [--config tiny] [--steps 256] [--every 32] [--plot low_bandwidth.png]
                                       [--warm-start STEPS]
    JAX_PLATFORMS=cpu python benchmarks/low_bandwidth.py --pod     # llama3-8b's syncs on 2 x v6e-256

Every method trains the same config from the same initial weights on the same batches, on 8
simulated devices (data=4 replicas x fsdp=2), and is evaluated on the held-out set every
`--every` steps (the synced parameters: what a DiLoCo run would save). Bytes are read from
the compiled programs (each device's share of every collective that crosses `data`, ring
algorithms), averaged over a sync period: inner steps send nothing, a sync sends a fragment.

With `--warm-start W` every method starts instead from the weights of W all-reduce steps
(a fresh optimizer, step 0's schedule) and trains on the batches after those W: the papers
compare their methods from pre-trained weights, not from random ones.

The last columns are estimates, labelled so: the seconds each step's `data` traffic would
take on a link of `--link-gbps` gigabits per second per device, from the measured bytes.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxpar.aot.compile import compile_step, crossing_bytes, data_sync_traffic  # noqa: E402
from jaxpar.config import load_config  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

AVERAGE = ["train.diloco.outer_learning_rate=1.0", "train.diloco.outer_momentum=0.0"]
METHODS = {
    "allreduce": [],
    "diloco H=8": ["train.sync=diloco", "train.diloco.every=8"],
    "diloco H=32": ["train.sync=diloco", "train.diloco.every=32"],
    "diloco H=128": ["train.sync=diloco", "train.diloco.every=128"],
    # The outer step as a plain average (outer learning rate 1, no momentum), at H = 1, 4, 16.
    "average H=1": ["train.sync=diloco", "train.diloco.every=1", *AVERAGE],
    "average H=4": ["train.sync=diloco", "train.diloco.every=4", *AVERAGE],
    "average H=16": ["train.sync=diloco", "train.diloco.every=16", *AVERAGE],
    "diloco H=16 momentum 0.5": ["train.sync=diloco", "train.diloco.every=16", "train.diloco.outer_momentum=0.5"],
    "diloco H=16": ["train.sync=diloco", "train.diloco.every=16"],
    "streaming H=32 P=2 4-bit": ["train.sync=streaming_diloco", "train.diloco.every=32", "train.diloco.fragments=2"],
    "sparseloco H=32 2-bit 1/32": ["train.sync=sparseloco", "train.diloco.every=32"],
    "sparseloco H=32 2-bit 1/32 Nesterov 0.9": ["train.sync=sparseloco", "train.diloco.every=32",
                                                "train.diloco.outer_learning_rate=0.7", "train.diloco.outer_momentum=0.9"],
}
# The default run: the set; the rest on request (--methods).
DEFAULT = ["allreduce", "diloco H=8", "diloco H=32", "diloco H=128", "streaming H=32 P=2 4-bit",
           "sparseloco H=32 2-bit 1/32"]
MESH = ["mesh.data=4", "mesh.fsdp=2"]


def data_bytes(trainer) -> float:
  """Bytes each device sends over `data` per step, averaged over a sync period."""
  inner, _ = compile_step(trainer)
  if trainer.replicas is None:
    return crossing_bytes(inner, trainer.mesh)
  return data_sync_traffic(trainer, inner)["per_step"]


def _config(name, overrides, args, workdir, steps):
  return load_config(args.config, MESH + overrides + [
      f"train.steps={steps}", f"eval.every_steps={args.every}", f"eval.steps={args.eval_batches}",
      f"train.run_dir={workdir}/{name.replace(' ', '_').replace('/', '-')}", "checkpoint.enabled=false",
      "train.log_every=0", "train.sample_tokens=0", *args.set])


def warm_weights(args, workdir):
  """The parameters after --warm-start all-reduce steps (host arrays)."""
  result = Trainer(_config("warm", [], args, workdir, args.warm_start)).fit(show_progress=False)
  print(f"  warm start: {args.warm_start} all-reduce steps, loss {result.summary['final_loss']:.4f}", flush=True)
  return jax.device_get(result.state.params)


def run(name, overrides, args, workdir, warm=None):
  config = _config(name, overrides, args, workdir, args.steps)
  trainer = Trainer(config)
  per_step = data_bytes(trainer)
  state = batches = None
  if warm is not None:  # from the warm weights, on the batches after the warm-up's
    state, batches = trainer.state_from(warm), trainer.batches()
    for _ in range(args.warm_start):
      next(batches)
  started = time.perf_counter()
  result = trainer.fit(state, batches, show_progress=False)
  key = next(k for h in result.history for k in h if k.startswith("eval/") and k.endswith("/loss"))
  evals = [(h["step"], h[key]) for h in result.history if key in h]
  tokens = config.data.global_batch_size * config.data.seq_len
  drift = [h["sync/drift"] for h in result.history if "sync/drift" in h]
  return {"name": name, "bytes": per_step, "evals": evals, "tokens_per_step": tokens,
          "final": evals[-1][1], "wall_s": time.perf_counter() - started, "drift": drift[-1] if drift else None}


def table(rows, link_gbps: float):
  base = rows[0]
  print(f"\n| method | bytes over data per step | vs all-reduce | final eval loss | gap | last drift | "
        f"link s/step at {link_gbps:g} Gb/s (estimate) |")
  print("|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    ratio = base["bytes"] / r["bytes"] if r["bytes"] else float("inf")
    gap = r["final"] / base["final"] - 1
    drift = f"{r['drift']:.2e}" if r["drift"] is not None else "-"
    print(f"| {r['name']} | {r['bytes'] / 1e6:,.3f} MB | {ratio:,.0f}x | {r['final']:.4f} | {gap:+.2%} | {drift} | "
          f"{r['bytes'] * 8 / (link_gbps * 1e9):.4f} |")
  steps = [s for s, _ in base["evals"]]
  print(f"\neval loss by step ({base['tokens_per_step']:,} tokens per step):\n")
  print("| method | " + " | ".join(str(s) for s in steps) + " |")
  print("|---|" + "---:|" * len(steps))
  for r in rows:
    print(f"| {r['name']} | " + " | ".join(f"{loss:.4f}" for _, loss in r["evals"]) + " |")


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
  for r in rows:
    steps = [s for s, _ in r["evals"]]
    losses = [loss for _, loss in r["evals"]]
    by_tokens.plot([s * r["tokens_per_step"] for s in steps], losses, marker="o", label=r["name"])
    by_bytes.plot([max(s * r["bytes"], 1.0) for s in steps], losses, marker="o", label=r["name"])
  by_tokens.set(xlabel="tokens", ylabel="eval loss", title="eval loss against tokens")
  by_bytes.set(xlabel="bytes sent over data per device", xscale="log", title="eval loss against bytes")
  by_tokens.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"\nwrote {path}")


POD = {"diloco": ["train.sync=diloco", "train.diloco.every=32"],
       "streaming_diloco": ["train.sync=streaming_diloco", "train.diloco.every=32", "train.diloco.fragments=2"]}


def pod(methods):
  """llama3-8b on 2 x v6e-256 with `data` (2 replicas) over DCN, compile-only: each sync
  program's bytes across slices per device, beside the hand count. The inner step is the
  program tests/test_replicas.py checks sends nothing over `data`; `jaxpar compile` with the
  same overrides reports it (and the all-reduce run) in full, at a compile of ~15 min each here."""
  from jaxpar.aot.chips import topology_devices
  _, devices = topology_devices("v6e-256", 2)
  for name in methods:
    config = load_config("llama3-8b", ["mesh.num_slices=2", "mesh.data=2", "data.global_batch_size=1024"] + POD[name])
    trainer = Trainer(config, devices)
    r = trainer.replicas
    total = least = 0.0
    for p in range(r.settings.fragments):
      started = time.perf_counter()
      compiled, _ = compile_step(trainer, program=r.program(p), name=f"sync {p}")
      sent = crossing_bytes(compiled, trainer.mesh)
      hand = r.least_wire_bytes(p)
      total, least = total + sent, least + hand
      print(f"{name} sync {p}: DCN {sent / 2**20:.1f} MiB per device (hand {hand / 2**20:.1f} MiB), temporaries "
            f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB, compiled in "
            f"{time.perf_counter() - started:.0f} s", flush=True)
    every = r.settings.every
    print(f"{name}: per step over a period of {every}: {total / every / 2**20:.2f} MiB "
          f"(hand {least / every / 2**20:.2f} MiB)", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="tiny")
  parser.add_argument("--steps", type=int, default=256)
  parser.add_argument("--every", type=int, default=32, help="evaluate every this many steps")
  parser.add_argument("--eval-batches", type=int, default=8)
  parser.add_argument("--methods", nargs="*", default=DEFAULT, choices=list(METHODS))
  parser.add_argument("--link-gbps", type=float, default=1.0)
  parser.add_argument("--plot", default=None, help="write the two curves to this PNG")
  parser.add_argument("--set", nargs="*", default=[], help="more config overrides, key=value")
  parser.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                      help="start every method from the weights of this many all-reduce steps")
  parser.add_argument("--pod", nargs="*", choices=list(POD), help="instead: the llama3-8b syncs on 2 x v6e-256 "
                      "(compile-only; needs the tpu extra and JAX_PLATFORMS=cpu)")
  args = parser.parse_args()
  if args.pod is not None:
    return pod(args.pod or list(POD))
  print(f"{args.config}, {args.steps} steps, data=4 x fsdp=2 on {jax.device_count()} {jax.devices()[0].platform} devices")
  rows = []
  with tempfile.TemporaryDirectory() as workdir:
    warm = warm_weights(args, workdir) if args.warm_start else None
    for name in ["allreduce"] + [m for m in args.methods if m != "allreduce"]:
      rows.append(run(name, METHODS[name], args, workdir, warm))
      print(f"  {name}: final eval loss {rows[-1]['final']:.4f}, {rows[-1]['bytes'] / 1e6:.3f} MB/step, "
            f"{rows[-1]['wall_s']:.0f} s", flush=True)
  table(rows, args.link_gbps)
  if args.plot:
    plot(rows, args.plot)


if __name__ == "__main__":
  main()
