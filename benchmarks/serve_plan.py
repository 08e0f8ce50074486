"""How well `jaxpar plan --serve` orders serving layouts, against layouts measured here.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/serve_plan.py [--model tiny]
        [--context 256] [--slots 8] [--steps 32]

On this host's 8 simulated CPU devices, every candidate the planner keeps for `--model`
(replicas x tensor x data; the bfloat16 cache) is estimated with the planner's own roofline
(jaxpar/aot/serve_plan.py), with the host's measured matmul rate and copy bandwidth split
evenly over the devices (they share its cores), and then run: its replicas built on their
devices with random weights, every slot filled with a prompt of half the context, and
`--steps` decode steps timed with each replica on its own thread, as `jaxpar serve
--replicas` runs them. It prints both tokens/s per candidate and the Spearman rank
correlation between them.
"""

import argparse
import os
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def host_chip(devices: int):
  """This host as a chip per simulated device: its measured rates, shared evenly."""
  import jax.numpy as jnp
  import numpy as np

  from jaxpar.aot.chips import Chip
  from jaxpar.train.flops import measure_matmul_flops
  peak = measure_matmul_flops(jnp.dtype("float32"))
  buffer = np.ones(16 * 2 ** 20, np.float32)
  started = time.perf_counter()
  for _ in range(5):
    buffer.copy()
  bandwidth = 5 * 2 * buffer.nbytes / (time.perf_counter() - started)  # read and write
  return Chip("host", 2 ** 31, peak / devices, bandwidth / devices, bandwidth / devices, bandwidth / devices, 2, 1)


def measure(config, candidate, devices, context: int, steps: int) -> float:
  """Decode tokens/s of `candidate`'s replicas stepping together, every slot busy."""
  from jaxpar.aot.serve_plan import _mesh
  from jaxpar.data.tokenizer import ByteTokenizer
  from jaxpar.inference import Engine, SamplingParams
  from jaxpar.runtime import Runtime
  per = len(devices) // candidate.replicas
  engines = []
  for r in range(candidate.replicas):
    runtime = Runtime(config.model, _mesh(config, candidate.mesh), devices[r * per:(r + 1) * per])
    params, model_state = runtime.init()
    engine = Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=candidate.slots,
                    max_seq_len=context + steps + 8, page_size=16, prefill_chunks=(context // 2,),
                    prefix_caching=False)
    for s in range(candidate.slots):
      engine.submit([(7 * s + t) % 250 + 1 for t in range(context // 2)],
                    SamplingParams(max_tokens=steps + 8, stop_token_ids=()))
    while any(r is None or r.prefilling for r in engine.slots) or engine.pending:
      engine.step()
    engines.append(engine)
  for engine in engines:  # one warm step each
    engine.step()
  barrier = threading.Barrier(len(engines) + 1)

  def run(engine):
    barrier.wait()
    for _ in range(steps):
      engine.step()
  threads = [threading.Thread(target=run, args=(e,)) for e in engines]
  for thread in threads:
    thread.start()
  barrier.wait()
  started = time.perf_counter()
  for thread in threads:
    thread.join()
  return sum(len(e.slots) for e in engines) * steps / (time.perf_counter() - started)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="tiny")
  parser.add_argument("--context", type=int, default=256)
  parser.add_argument("--slots", type=int, default=8, help="most slots per replica")
  parser.add_argument("--steps", type=int, default=32)
  args = parser.parse_args()
  import jax

  from jaxpar.aot.plan import spearman
  from jaxpar.aot.serve_plan import candidates
  from jaxpar.config import load_config
  longest = args.context + args.steps + 8
  config = load_config(args.model, [f"model.max_seq_len={longest}", f"data.seq_len={min(longest, 64)}"])
  devices = jax.devices()
  chip = host_chip(len(devices))
  kept, _, _ = candidates(config, None, args.context, args.slots, 16, kv_dtypes=("bfloat16",), devices=devices,
                          chip=chip)
  print(f"{args.model} on {len(devices)} simulated CPU devices ({os.cpu_count()} cores), context {args.context}, "
        f"at most {args.slots} slots per replica; host per device: {chip.peak_flops / 1e9:.1f} GFLOP/s, "
        f"{chip.hbm_bandwidth / 1e9:.2f} GB/s\n")
  print(f"{'candidate':<40} {'slots':>5} {'est tok/s':>10} {'measured tok/s':>15}")
  measured = []
  for candidate in kept:
    measured.append(measure(config, candidate, devices, args.context, args.steps))
    print(f"{str(candidate):<40} {candidate.slots:>5} {candidate.decode_tokens_s:>10,.0f} {measured[-1]:>15,.0f}",
          flush=True)
  rho = spearman([c.decode_tokens_s for c in kept], measured)
  print(f"\nSpearman rank correlation, estimated vs measured decode tokens/s: {rho:.2f} over {len(kept)} candidates")


if __name__ == "__main__":
  main()
