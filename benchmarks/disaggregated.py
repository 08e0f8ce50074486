"""Running decodes' inter-token latency while long prompts arrive: co-located against
disaggregated prefill (jaxpar/inference/disaggregated.py), side by side in one run.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/disaggregated.py
        [--model bench-20m] [--streams 4] [--prompt 384] [--every 0.5] [--seconds 12]

`--streams` requests with short prompts decode for the whole run (their tokens' gaps are
the latency measured, after the first second); every `--every` seconds a request with a
`--prompt`-token prompt and one output token arrives (pure prefill load). Co-located: one
engine on devices 0-3 does both, its prompt chunks sharing steps with the decodes.
Disaggregated: prompts are written on devices 0-3 and decoded on 4-7, each engine stepped on
its own thread as `jaxpar serve --prefill-devices 4` runs them. Each layout also runs with no
long prompts: the floor. The simulated devices share this host's cores, so the prefill
engine's work still slows the decode engine's steps here; on separate chips it would not.
"""

import argparse
import os
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def build(config, devices, slots: int, max_seq_len: int):
  from jaxpar.data import ByteTokenizer
  from jaxpar.inference import Engine
  from jaxpar.runtime import Runtime
  runtime = Runtime(config.model, config.mesh.model_copy(update={"data": -1, "fsdp": 1}), devices, seed=0)
  params, model_state = runtime.init()
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=slots, max_seq_len=max_seq_len,
                page_size=16, prefix_caching=False)


def run(layout, args, with_prompts: bool) -> list[float]:
  """Gaps (s) between the decoding streams' tokens while prompts arrive (or not)."""
  import numpy as np

  from jaxpar.inference import SamplingParams
  from jaxpar.inference.server import EngineWorker
  engines = layout.engines if hasattr(layout, "engines") else [layout]
  workers = [EngineWorker(e) for e in engines]
  if len(workers) > 1:
    layout.deliver = workers[1].enqueue
  gaps, last, lock = [], {}, threading.Lock()
  started = time.monotonic()

  def listen(request_id):
    def on_event(event):
      now = time.monotonic()
      with lock:
        if event.token is not None and request_id in last and now - started > 1.0:
          gaps.append(now - last[request_id])
        last[request_id] = now
    return on_event
  rng = np.random.default_rng(0)
  first = engines[0]
  streams = [first.make_request([int(t) for t in rng.integers(1, 250, 16)],
                                SamplingParams(max_tokens=100_000, stop_token_ids=()), listen(i))
             for i in range(args.streams)]
  workers[0].enqueue(streams)
  while time.monotonic() - started < args.seconds:
    if with_prompts:
      workers[0].enqueue([first.make_request([int(t) for t in rng.integers(1, 250, args.prompt)],
                                             SamplingParams(max_tokens=1, stop_token_ids=()))])
    time.sleep(args.every)
  for request in streams:
    request.cancelled = True
  for worker in workers:
    worker.close(grace_s=0)
  return gaps


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="bench-20m")
  parser.add_argument("--streams", type=int, default=4)
  parser.add_argument("--prompt", type=int, default=384)
  parser.add_argument("--every", type=float, default=0.5)
  parser.add_argument("--seconds", type=float, default=12.0)
  args = parser.parse_args()
  import jax
  import numpy as np

  from jaxpar.config import load_config
  from jaxpar.inference.disaggregated import Disaggregated
  max_seq_len = args.prompt + 64 + int(args.seconds * 200)
  config = load_config(args.model, [f"model.max_seq_len={max_seq_len}", "data.seq_len=64"])
  devices = jax.devices()
  slots = args.streams + 4
  layouts = {
      "co-located (devices 0-3)": lambda: build(config, devices[:4], slots, max_seq_len),
      "disaggregated (0-3 -> 4-7)": lambda: Disaggregated(build(config, devices[:4], slots, max_seq_len),
                                                          build(config, devices[4:], slots, max_seq_len)),
  }
  print(f"{args.model}: {args.streams} decoding streams; a {args.prompt}-token prompt every {args.every} s or none; "
        f"{args.seconds:.0f} s each; {os.cpu_count()} cores\n")
  print(f"{'layout':<28} {'long prompts':>12} | {'ITL p50':>8} {'p90':>8} {'p99':>8} {'max':>8} (ms) | tokens")
  for name, make in layouts.items():
    layout = make()
    for with_prompts in (False, True):
      gaps = np.asarray(run(layout, args, with_prompts)) * 1000
      print(f"{name:<28} {'yes' if with_prompts else 'no':>12} | {np.percentile(gaps, 50):>8.1f} "
            f"{np.percentile(gaps, 90):>8.1f} {np.percentile(gaps, 99):>8.1f} {gaps.max():>8.1f}      | {len(gaps)}",
            flush=True)


if __name__ == "__main__":
  main()
