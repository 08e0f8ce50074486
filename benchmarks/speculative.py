"""Speculative decoding on CPU, side by side in one run: plain decoding, a draft model, and
n-gram prompt lookup, at batch 1 and 8, on prose and on text that repeats itself.

    python benchmarks/speculative.py [--steps 300] [--batches 1 8] [--new 96] [--k 4]

The target is the embedded default (tiny: 4 layers x 128) trained `--steps` steps on the
bundled corpus, the draft model a 1-layer x 64 model trained alike (speculation needs drafts
that agree with their target, which random weights do not). Greedy, one CPU device; each
time is the best of 2 after a warm-up. For each: wall-clock seconds for the batch, the
speed-up over plain decoding, acceptance (kept / proposed) and tokens per target pass, and
whether the tokens equal plain decoding's.
"""

import argparse

from decode import best, trained_engine  # benchmarks/decode.py

from jaxpar.inference import Engine, SamplingParams
from jaxpar.inference.speculative import DraftModel, NgramDraft

PROSE = ["It is a truth universally acknowledged", "Mr. Darcy", "She was", "The ball at Netherfield",
         "Elizabeth", "My dear", "In vain have I struggled", "Lady Catherine"]
# The same openings, each quoted twice first: a continuation that repeats what it was given.
REPEATING = [f"{p}, said she. {p}, said he. {p}" for p in PROSE]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--new", type=int, default=96)
  parser.add_argument("--k", type=int, default=4)
  args = parser.parse_args()
  most = max(args.batches)
  target = trained_engine([], args.steps, most)
  draft = trained_engine(["model.num_layers=1", "model.embed_dim=64", "model.mlp_dim=192",
                          "model.head_dim=16", "model.scan_unroll=1"], args.steps, most, prefix_caching=False)
  sources = {"plain": None, "draft model": lambda: DraftModel(draft, args.k), "n-gram": lambda: NgramDraft(args.k)}
  settings = SamplingParams(max_tokens=args.new, stop_token_ids=())
  print(f"tiny trained {args.steps} steps (target) and a 1 x 64 draft trained alike; greedy, {args.new} new "
        f"tokens, k={args.k}, 1 CPU device\n")
  print(f"{'batch':>5} {'text':>10} {'decoding':>12} | {'seconds':>8} {'speed-up':>8} {'accepted':>8} "
        f"{'tok/pass':>8} {'same':>5}")
  for batch in args.batches:
    for text, prompts in (("prose", PROSE[:batch]), ("repeating", REPEATING[:batch])):
      want, plain_s = None, None
      for name, make in sources.items():
        engine = Engine(target.runtime, target.params, target.tokenizer, model_state=target.model_state,
                        slots=batch, max_seq_len=256, page_size=16, prefill_chunks=(64,),
                        speculative=make() if make else None)
        seconds = best(lambda: engine.generate(prompts, settings), 2)  # noqa: B023
        engine.stats.clear()  # the counts below: this one run's
        done = engine.generate(prompts, settings)
        tokens = [r.tokens for r in done]
        want, plain_s = (tokens, seconds) if make is None else (want, plain_s)
        proposed = sum(r.draft_proposed for r in done)
        kept = sum(r.draft_accepted for r in done)
        passes = engine.stats["speculative_rounds"] or engine.stats["decode_steps"] * batch
        print(f"{batch:>5} {text:>10} {name:>12} | {seconds:>8.2f} {plain_s / seconds:>7.2f}x "
              f"{(f'{kept / proposed:.0%}' if proposed else '-'):>8} "
              f"{sum(len(t) for t in tokens) / max(passes, 1):>8.2f} {str(tokens == want):>5}", flush=True)


if __name__ == "__main__":
  main()
