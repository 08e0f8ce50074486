"""Speculative decoding on CPU, side by side in one run: plain decoding, a draft model, n-gram
prompt lookup and Medusa heads, at batch 1, 4 and 16, on prose and on text that repeats itself.

    python benchmarks/speculative.py [--steps 400] [--head-steps 400] [--batches 1 4 16] [--new 96] [--k 4]

The target is bench-20m (embed 256, 4 layers, vocab 32000: 20M parameters, most of them in
the embedding and output projection) trained `--steps` steps on the bundled corpus; the draft
model a 1-layer x 64 model on the same vocabulary trained alike; the Medusa heads 4 residual
blocks on the target's output projection (`model.medusa.shared_projection`: a copy of the
projection per head would read 4x the target's biggest matrix every round) trained
`--head-steps` steps over the frozen target on the same text (`train.objective: medusa`).
Speculation needs drafts that agree with their target, which random weights do not.

Greedy, one CPU device, the same prompts for every source; each time is the best of 3 after
a warm-up. For each: wall-clock seconds for the batch, generated tokens/s, the speed-up over
plain decoding, acceptance (kept / proposed), tokens per target pass (per row), and whether
the tokens equal plain decoding's.
"""

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from decode import best  # noqa: E402  (benchmarks/decode.py)

from jaxpar.config import load_config  # noqa: E402
from jaxpar.inference import Engine, SamplingParams  # noqa: E402
from jaxpar.inference.medusa import MedusaDraft  # noqa: E402
from jaxpar.inference.speculative import DraftModel, NgramDraft  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

PROSE = ["It is a truth universally acknowledged", "Mr. Darcy", "She was", "The ball at Netherfield",
         "Elizabeth", "My dear", "In vain have I struggled", "Lady Catherine"]
PROSE = PROSE + [f"{p}, and" for p in PROSE]  # 16
# The same openings, each quoted twice first: a continuation that repeats what it was given.
REPEATING = [f"{p}, said she. {p}, said he. {p}" for p in PROSE]
ONE_DEVICE = jax.devices()[:1]


def train(root: Path, name: str, steps: int, overrides=()) -> Path:
  """bench-20m with `overrides` trained `steps` steps on the bundled corpus -> its run dir."""
  run_dir = root / name
  config = load_config("bench-20m", [f"train.steps={steps}", "train.learning_rate=1e-3", "mesh.fsdp=1",
                                     "train.log_every=0", f"train.run_dir={run_dir}", *overrides])
  result = Trainer(config, devices=ONE_DEVICE).fit(show_progress=False)
  print(f"  {name}: {steps} steps, loss {result.summary['first_loss']:.2f} -> {result.summary['final_loss']:.2f}",
        flush=True)
  return run_dir


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--head-steps", type=int, default=400)
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
  parser.add_argument("--new", type=int, default=96)
  parser.add_argument("--k", type=int, default=4)
  args = parser.parse_args()
  root = Path(tempfile.mkdtemp(prefix="jaxpar-bench-spec-"))
  print("training (bench-20m target, 1 x 64 draft, 4 Medusa heads):", flush=True)
  target = train(root, "target", args.steps)
  draft = train(root, "draft", args.steps, ["model.num_layers=1", "model.embed_dim=64", "model.mlp_dim=192",
                                            "model.head_dim=16", "model.scan_unroll=1"])
  heads = train(root, "heads", args.head_steps, ["train.objective=medusa", f"model.medusa.heads={args.k}",
                                                 "model.medusa.shared_projection=true", f"model.medusa.base={target}"])
  settings = SamplingParams(max_tokens=args.new, temperature=0.0, stop_token_ids=())
  print(f"\ngreedy, {args.new} new tokens, k={args.k}, 1 CPU device\n")
  print(f"{'batch':>5} {'text':>10} {'decoding':>12} | {'seconds':>8} {'tok/s':>7} {'speed-up':>8} {'accepted':>8} "
        f"{'tok/pass':>8} {'same':>5}")
  for batch in args.batches:
    options = dict(mesh={"fsdp": 1}, devices=ONE_DEVICE, slots=batch, max_seq_len=256, page_size=16,
                   prefill_chunks=(64,))
    sources = {
        "plain": lambda: Engine.from_checkpoint(target, **options),  # noqa: B023
        "draft model": lambda: Engine.from_checkpoint(target, **options, speculative=DraftModel(  # noqa: B023
            Engine.from_checkpoint(draft, **options, prefix_caching=False), args.k)),  # noqa: B023
        "n-gram": lambda: Engine.from_checkpoint(target, **options, speculative=NgramDraft(args.k)),  # noqa: B023
        "medusa": lambda: Engine.from_checkpoint(heads, **options, speculative=MedusaDraft(args.k)),  # noqa: B023
    }
    engines = {name: make() for name, make in sources.items()}
    for text, prompts in (("prose", PROSE[:batch]), ("repeating", REPEATING[:batch])):
      want = plain_s = None
      for name, engine in engines.items():
        seconds = best(lambda: engine.generate(prompts, settings), 3)  # noqa: B023
        engine.stats.clear()  # the counts below: this one run's
        done = engine.generate(prompts, settings)
        tokens = [r.tokens for r in done]
        want, plain_s = (tokens, seconds) if name == "plain" else (want, plain_s)
        proposed = sum(r.draft_proposed for r in done)
        kept = sum(r.draft_accepted for r in done)
        passes = engine.stats["speculative_rounds"] or engine.stats["decode_steps"] * batch
        generated = sum(len(t) for t in tokens)
        print(f"{batch:>5} {text:>10} {name:>12} | {seconds:>8.2f} {generated / seconds:>7.0f} "
              f"{plain_s / seconds:>7.2f}x {(f'{kept / proposed:.0%}' if proposed else '-'):>8} "
              f"{generated / max(passes, 1):>8.2f} {str(tokens == want):>5}", flush=True)


if __name__ == "__main__":
  main()
