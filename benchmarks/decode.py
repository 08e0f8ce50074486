"""Decode speed on CPU: jaxpar's engine against Hugging Face `transformers` generate.

    python benchmarks/decode.py [--batches 1 8 32] [--prompt 64] [--new 64] [--repeats 3] [--burst 4]

Both run the bench-20m shape (embed 256, 4 layers, 4 heads x 64, MLP 1024, vocab 32000,
float32) with random weights, greedy, prompts of 64 random tokens, 64 new tokens, on the
same host in the same run. Both are timed the same way: a call that generates 1 token
(time to first token) and one that generates all 64; decode tokens/s = batch x 63 /
(the difference). Best of `--repeats` rounds after a warm-up, each round running every
system once in turn (the host's speed drifts: this way each gets the same moments). jaxpar runs twice: one decode step
per call, and `--burst` steps per call (`Engine(decode_burst=K)`: the same tokens, streamed
K at a time; the first token still comes from a single step). Then: the same requests on an engine
sized for 2048 positions, with and without narrower page tables; continuous batching under a
stream of mixed-length requests. Speculative decoding: benchmarks/speculative.py.
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.config import MeshConfig, load_config  # noqa: E402
from jaxpar.data import ByteTokenizer  # noqa: E402
from jaxpar.convert.hf import hf_config_from_model  # noqa: E402
from jaxpar.inference import Engine, SamplingParams  # noqa: E402
from jaxpar.runtime import Runtime  # noqa: E402


def best(fn, repeats):
  fn()  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def engine_for(model_cfg, slots, prompt, new, seed=0, **options):
  """An engine for `slots` requests of `prompt` + `new` tokens; `options` go to Engine."""
  runtime = Runtime(model_cfg, MeshConfig(fsdp=1), jax.devices()[:1], seed=seed)
  params, model_state = runtime.init()
  return Engine(runtime, params, ByteTokenizer(), model_state=model_state, slots=slots,
                max_seq_len=prompt + new + 8, page_size=16, prefill_chunks=(prompt,), **options)


def jaxpar_generate(model_cfg, batch, prompts, new, decode_burst=1, **options):
  """run(n): the engine generating n tokens for each prompt."""
  engine = engine_for(model_cfg, batch, len(prompts[0]), new, decode_burst=decode_burst, **options)
  return lambda n: engine.generate(prompts, SamplingParams(max_tokens=n, stop_token_ids=()))


def hf_generate(model_cfg, prompts):
  """run(n): transformers' `generate` of exactly n greedy tokens for each prompt."""
  import torch
  import transformers
  config = transformers.LlamaConfig(**{k: v for k, v in hf_config_from_model(model_cfg, "float32").items()
                                       if k not in ("architectures", "model_type", "torch_dtype")})
  model = transformers.LlamaForCausalLM(config).eval()
  ids = torch.tensor(prompts)

  def run(n):
    with torch.no_grad():
      model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
  return run


def side_by_side(runs: dict, new, repeats) -> dict:
  """{name: (seconds for 1 token, seconds for `new`)}, each the best of `repeats` rounds in
  which every system runs once in turn: on a host whose speed drifts, each system then gets
  the same quiet and busy moments."""
  for run in runs.values():
    run(1), run(new)  # warm-up
  times = {name: [float("inf"), float("inf")] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      for i, n in enumerate((1, new)):
        start = time.perf_counter()
        run(n)
        times[name][i] = min(times[name][i], time.perf_counter() - start)
  return {name: tuple(t) for name, t in times.items()}


def jaxpar_times(model_cfg, batch, prompts, new, repeats, decode_burst=1):
  return side_by_side({"jaxpar": jaxpar_generate(model_cfg, batch, prompts, new, decode_burst)}, new,
                      repeats)["jaxpar"]


def hf_times(model_cfg, prompts, new, repeats):
  return side_by_side({"hf": hf_generate(model_cfg, prompts)}, new, repeats)["hf"]


def roomy_engine(model_cfg, batch, prompt, new, repeats, max_seq_len=2048):
  """Decode tok/s of an engine sized for `max_seq_len` (as `jaxpar serve` sizes it: the
  model's context) on the same short requests: with the narrower page tables the decode
  step is compiled for (pages.table_widths), and with the full table only."""
  prompts = np.random.default_rng(batch).integers(0, 256, (batch, prompt)).tolist()
  roomy = model_cfg.model_copy(update={"max_seq_len": max_seq_len})  # rope: the same weights
  engine = engine_for(roomy, batch, prompt, max_seq_len - prompt - 8)
  run = lambda n: engine.generate(prompts, SamplingParams(max_tokens=n, stop_token_ids=()))  # noqa: E731
  rates, compiled = {}, engine.step_widths
  for label, widths in (("narrower tables", compiled), ("full table", compiled[-1:])):
    engine.step_widths = widths
    first, all_ = best(lambda: run(1), repeats), best(lambda: run(new), repeats)
    rates[label] = batch * (new - 1) / (all_ - first)
  return compiled, rates


def continuous_batching(model_cfg, requests=48, slots=8, seed=0):
  """Requests of mixed prompt (8..200) and output (8..64) lengths, all queued at once."""
  rng = np.random.default_rng(seed)
  engine = engine_for(model_cfg, slots, 64, 64 + 200)
  prompts = [rng.integers(0, 256, rng.integers(8, 200)).tolist() for _ in range(requests)]
  settings = [SamplingParams(max_tokens=int(rng.integers(8, 65)), stop_token_ids=()) for _ in range(requests)]
  engine.generate(prompts[:2], settings[:2])  # warm-up
  start = time.perf_counter()
  done = engine.generate(prompts, settings)
  elapsed = time.perf_counter() - start
  return sum(len(d.tokens) for d in done) / elapsed, engine.stats


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt", type=int, default=64)
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--burst", type=int, default=4, help="decode steps per call in the burst column")
  args = parser.parse_args()
  model_cfg = load_config("bench-20m").model
  print(f"bench-20m shape, random weights, greedy, prompt {args.prompt}, {args.new} new tokens, "
        f"{os.cpu_count()} cores\n")
  burst = f"burst {args.burst}"
  print(f"{'batch':>5} | {'jaxpar TTFT':>11} {'tok/s':>8} {burst:>9} | {'HF TTFT':>9} {'tok/s':>8} | "
        f"{'TTFT x':>6} {'tok/s x':>7} {burst + ' x':>9}")
  for batch in args.batches:
    prompts = np.random.default_rng(batch).integers(0, 256, (batch, args.prompt)).tolist()
    times = side_by_side({"jaxpar": jaxpar_generate(model_cfg, batch, prompts, args.new),
                          "burst": jaxpar_generate(model_cfg, batch, prompts, args.new, args.burst),
                          "hf": hf_generate(model_cfg, prompts)}, args.new, args.repeats)
    (j1, jn), (b1, bn), (h1, hn) = times["jaxpar"], times["burst"], times["hf"]
    jrate, brate, hrate = (batch * (args.new - 1) / (n - first) for first, n in ((j1, jn), (b1, bn), (h1, hn)))
    print(f"{batch:>5} | {j1 * 1e3:>9.1f}ms {jrate:>8,.0f} {brate:>9,.0f} | {h1 * 1e3:>7.1f}ms {hrate:>8,.0f} | "
          f"{h1 / j1:>5.2f}x {jrate / hrate:>6.2f}x {brate / hrate:>8.2f}x", flush=True)
  widths, rates = roomy_engine(model_cfg, 32, args.prompt, args.new, args.repeats)
  print(f"\nan engine sized for 2048 positions, batch 32, the same requests: "
        + ", ".join(f"{label} {rate:,.0f} tok/s" for label, rate in rates.items())
        + f" (tables of {', '.join(str(w * 16) for w in widths)} positions compiled)")
  rate, stats = continuous_batching(model_cfg)
  print(f"\ncontinuous batching: 48 requests (prompts 8-200, outputs 8-64 tokens), 8 slots: "
        f"{rate:,.0f} generated tokens/s ({stats['decode_steps']} decode steps, "
        f"{stats['prefill_tokens']} prompt tokens prefilled, {stats['preemptions']} preemptions)")


if __name__ == "__main__":
  main()
