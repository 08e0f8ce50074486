"""Training in less precision (`model.train_precision`): loss curves and step times, side by side.

    python benchmarks/precision_memory.py --part curves [--config tiny] [--steps 300] [--variants ...]
    python benchmarks/precision_memory.py --part step     # on a GPU: 12 x 768 Llama, bf16; on CPU: tiny
    python benchmarks/precision_memory.py --part matmul --topology v5p:2x2x1   # compile-only

curves: every scheme, and the float run with bf16 or 8-bit optimizer moments
(train.optimizer_state_dtype) or GaLore (train.optimizer=galore), trains the same config from the same initial weights on the
same batches (the bundled corpus); the table gives the loss at every `--every` steps and each
run's final loss relative to the first's. It runs wherever jaxpar runs (on CPU the
low-precision dots are converted by XLA: same numbers, no speed-up).

step: the seconds per train step of each scheme on this backend's first device (median of
`--repeats` steps after two warm-ups, one repeated batch; the schemes one after another in
one process), the tokens/s ratio against the bf16 run, and the compiled program's native fp8
and int8 dots (what tells a native low-precision matmul from a converted one). `--set` changes
the model, e.g. four Llama-3-8B layers:

    python benchmarks/precision_memory.py --part step --set model.num_layers=4 model.embed_dim=4096 \
        model.num_heads=32 model.num_kv_heads=8 model.head_dim=128 model.mlp_dim=14336 \
        model.max_seq_len=2048 data.seq_len=2048 data.global_batch_size=4

matmul: one projection's forward and both gradients ([M, K] @ [K, N], bf16 operands) compiled
for one chip of `--topology` (libtpu on this host; `local`: this backend), with each scheme's
temporary bytes beside the output's f32 size: what fp8_blockwise's per-tile products (one
batched dot of K / 128 tiles, then their scaled sum) cost where the compiler does or does not
fuse the sum into the dot.
"""

import argparse
import re
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import load_config
from jaxpar.models.low_precision import SCHEMES
from jaxpar.train.trainer import Trainer

PRECISIONS = ("compute_dtype", *SCHEMES)
# The curves: each train precision, and the float run with narrower optimizer moments.
VARIANTS = {**{p: [f"model.train_precision={p}"] for p in PRECISIONS},
            "moments_bf16": ["train.optimizer_state_dtype=bfloat16"],
            "moments_int8": ["train.optimizer_state_dtype=int8_blockwise"],
            # GaLore at a quarter of tiny's embed (128): the defaults (a refresh every 200 steps,
            # the paper's scale 0.25), then refreshed every 50 steps, at scale 0.25 and 1; and at half.
            "galore": ["train.optimizer=galore", "train.galore.rank=32"],
            "galore_t50": ["train.optimizer=galore", "train.galore.rank=32", "train.galore.update_every=50"],
            "galore_t50_scale1": ["train.optimizer=galore", "train.galore.rank=32", "train.galore.update_every=50",
                                  "train.galore.scale=1.0"],
            "galore_r64_scale1": ["train.optimizer=galore", "train.galore.rank=64", "train.galore.update_every=50",
                                  "train.galore.scale=1.0"]}
# The `jaxpar check` train step's model on accelerators (GPT-2-small-sized Llama, bf16).
GPU_MODEL = ["model.embed_dim=768", "model.num_layers=12", "model.num_heads=12", "model.num_kv_heads=12",
             "model.head_dim=64", "model.mlp_dim=3072", "model.max_seq_len=1024",
             "model.compute_dtype=bfloat16", "data.seq_len=1024", "data.global_batch_size=8"]


def _trainer(config_name, variant, extra):
  overrides = [*VARIANTS[variant], "checkpoint.enabled=false", "mesh.fsdp=1",
               f"train.run_dir=runs/precision-{variant}", *extra]
  return Trainer(load_config(config_name, overrides), jax.local_devices()[:1])


def curves(args):
  losses, names = {}, args.variants
  for name in names:
    trainer = _trainer(args.config, name, [f"train.steps={args.steps}"])
    state, batches = trainer.init_state(), trainer.batches()
    start = time.perf_counter()
    values = []
    for _ in range(args.steps):
      state, metrics = trainer.step(state, next(batches))
      values.append(metrics["loss"])
    losses[name] = np.array(jax.device_get(values), np.float64)
    print(f"{name}: {args.steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
  marks = list(range(0, args.steps, args.every)) + [args.steps - 1]
  print(f"\n{args.config}, loss at step (mean of the {args.window} steps ending there):\n")
  print("| step | " + " | ".join(names) + " |")
  print("|" + " --- |" * (len(names) + 1))
  window = lambda v, i: v[max(0, i + 1 - args.window):i + 1].mean()  # noqa: E731
  for i in marks:
    print(f"| {i + 1} | " + " | ".join(f"{window(losses[p], i):.4f}" for p in names) + " |")
  final = {p: window(losses[p], args.steps - 1) for p in names}
  print(f"| final vs {names[0]} | " + " | ".join(f"{100 * (final[p] / final[names[0]] - 1):+.2f}%"
                                                for p in names) + " |")


def _low_precision_dots(text: str) -> str:
  """The compiled program's fp8 GEMMs (cuBLASLt's fp8 matmul calls on GPU) and its int8 dots
  (s8 x s8 -> s32, which XLA's GPU backend runs as Triton GEMM fusions): native matmuls, not
  converted ones."""
  fp8 = text.count('custom_call_target="__cublas$lt$matmul$f8"')
  int8 = len(re.findall(r"= s32\[[0-9,]*\]\{[0-9,]*\} dot\(", text))
  return f"{fp8} fp8 / {int8} int8"


def step(args):
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}\n")
  rows = []
  for precision in args.precisions:
    accelerated = jax.default_backend() != "cpu"
    trainer = _trainer("bench-20m" if accelerated else "tiny", precision,
                       [*(GPU_MODEL if accelerated else []), *args.set])
    state, batch = trainer.init_state(), next(trainer.batches())
    with trainer.context():
      compiled = trainer.train_step.lower(state, batch).compile()
      text = compiled.as_text()
      if args.save_hlo:
        Path(args.save_hlo, f"{precision}.hlo.txt").write_text(text)
      first = None
      for _ in range(2):
        state, metrics = compiled(state, batch)
        first = first if first is not None else float(metrics["loss"])
      seconds = []
      for _ in range(args.repeats):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - start)
    calls = _low_precision_dots(text)
    tokens = trainer.config.data.global_batch_size * trainer.config.data.seq_len
    rows.append((precision, statistics.median(seconds), tokens, calls, first, float(metrics["loss"])))
    print(f"{precision}: {1e3 * rows[-1][1]:.2f} ms", flush=True)
  base = rows[0][1]
  print("\n| precision | step ms | tokens/s | vs compute_dtype | low-precision dots in the program | loss first -> last (one batch) |")
  print("| --- | --- | --- | --- | --- | --- |")
  for precision, seconds, tokens, calls, first, last in rows:
    print(f"| {precision} | {1e3 * seconds:.2f} | {tokens / seconds:,.0f} | {base / seconds:.2f}x | {calls} | "
          f"{first:.3f} -> {last:.3f} |")


def matmul(args):
  if args.topology == "local":
    device = jax.devices()[0]
  else:
    from jax.experimental import topologies
    device = topologies.get_topology_desc(platform="tpu", topology_name=args.topology).devices[0]
  import jax.numpy as jnp
  from jaxpar.models import low_precision_delayed as delayed
  from jaxpar.models.low_precision import low_precision_matmul
  one = jax.sharding.SingleDeviceSharding(device)
  m, k, n = args.shape
  shapes = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=one) for shape in ((m, k), (k, n), (m, n))]
  print(f"{device.device_kind}: [{m} x {k}] @ [{k} x {n}], forward + both gradients; "
        f"the f32 product is {m * n * 4 / 2**20:,.0f} MiB\n")
  print("| precision | temporaries MiB | x the f32 product |")
  print("| --- | --- | --- |")
  for precision in args.precisions:
    product = (lambda x, w: x @ w) if precision == "compute_dtype" else (
        lambda x, w, p=precision: low_precision_matmul(x, w, p, delayed.amax_history(p, 16)))
    loss = lambda x, w, c, f=product: jnp.sum((f(x, w) * c).astype(jnp.float32))  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*shapes).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"| {precision} | {temp / 2**20:,.0f} | {temp / (m * n * 4):.2f} |")


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--part", choices=["curves", "step", "matmul"], default="curves")
  parser.add_argument("--config", default="tiny", help="curves: the config trained")
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                      help="curves: these runs, the first as the baseline (compute_dtype: the float run)")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--every", type=int, default=50)
  parser.add_argument("--window", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS,
                      help="step: these, the first as the baseline")
  parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                      help="step: config overrides after the default model's (another width, say)")
  parser.add_argument("--save-hlo", metavar="DIR", help="step: write each compiled program's HLO text there")
  parser.add_argument("--topology", default="v5p:2x2x1", help="matmul: a TPU topology, or local")
  parser.add_argument("--shape", nargs=3, type=int, default=[4096, 4096, 8192], metavar=("M", "K", "N"),
                      help="matmul: the projection's tokens, inputs and outputs")
  args = parser.parse_args()
  {"curves": curves, "step": step, "matmul": matmul}[args.part](args)


if __name__ == "__main__":
  main()
