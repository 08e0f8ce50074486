"""Speculative decoding on CPU, side by side in one run: plain decoding, a draft model, n-gram
prompt lookup and Medusa heads (a chain, and a tree grown from their measured accuracies), at
batch 1, 4 and 16, on prose and on text that repeats itself; and (`--part mtp`) a
DeepSeek-style model's own multi-token-prediction module against plain decoding of it.

    python benchmarks/speculative.py [--config bench-50m] [--steps 400] [--head-steps 400]
                                     [--batches 1 4 16] [--new 96] [--k 4] [--tree 8] [--runs DIR]
                                     [--part all|main|mtp] [--mtp-config tiny-deepseek] [--mtp-steps 400]

The target is `--config` (bench-50m: embed 512, 8 layers, tied vocab 32000; or bench-20m)
trained `--steps` steps on the bundled corpus; the draft model a 1-layer x 64 model on the
same vocabulary trained alike; the Medusa heads `--k` residual blocks on the target's output
projection (`model.medusa.shared_projection`: a copy of the projection per head would read
k times the target's biggest matrix every round) trained `--head-steps` steps over the frozen
target on the same text (`train.objective: medusa`). The tree: `--tree` nodes chosen by
`choose_tree` from the heads' per-rank accuracies on the bundled held-out text. Speculation
needs drafts that agree with their target, which random weights do not.

The MTP part trains `--mtp-config` (its own learning rate) `--mtp-steps` steps, prints the
module's held-out top-1 accuracy (guessing t_{i+2} from h_i and the true t_{i+1}) and how
often its guess is the model's own greedy choice there (what a k=1 proposal's acceptance
should be near), then plain decoding against `--speculative mtp` at k=1 and 2.

Greedy, one CPU device, the same prompts for every source; each time is the best of 3 after
a warm-up. For each: wall-clock seconds for the batch, generated tokens/s, the speed-up over
plain decoding, acceptance (kept / proposed), tokens per target pass (per row), the time of
one round (one target pass, with its draft work), and whether the tokens equal plain
decoding's.
"""

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from decode import best  # noqa: E402  (benchmarks/decode.py)

from jaxpar.config import load_config  # noqa: E402
from jaxpar.data.heldout import token_windows, window_batch  # noqa: E402
from jaxpar.data.sources import read_documents  # noqa: E402
from jaxpar.inference import Engine, SamplingParams  # noqa: E402
from jaxpar.inference.draft_tree import choose_tree  # noqa: E402
from jaxpar.inference.medusa import MedusaDraft  # noqa: E402
from jaxpar.inference.mtp import MtpDraft  # noqa: E402
from jaxpar.inference.speculative import DraftModel, NgramDraft  # noqa: E402
from jaxpar.objectives.medusa import rank_accuracy  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402
from jaxpar.weights import open_run  # noqa: E402

PROSE = ["It is a truth universally acknowledged", "Mr. Darcy", "She was", "The ball at Netherfield",
         "Elizabeth", "My dear", "In vain have I struggled", "Lady Catherine"]
PROSE = PROSE + [f"{p}, and" for p in PROSE]  # 16
# The same openings, each quoted twice first: a continuation that repeats what it was given.
REPEATING = [f"{p}, said she. {p}, said he. {p}" for p in PROSE]
ONE_DEVICE = jax.devices()[:1]


def train(config_name: str, root: Path, name: str, steps: int, overrides=()) -> Path:
  """`config_name` with `overrides` trained `steps` steps on the bundled corpus -> its run dir
  (one trained before in `root`, as it is)."""
  run_dir = root / name
  if (run_dir / "checkpoints").is_dir():
    print(f"  {name}: the run in {run_dir}", flush=True)
    return run_dir
  config = load_config(config_name, [f"train.steps={steps}", "train.learning_rate=1e-3", "mesh.fsdp=1",
                                     "train.log_every=0", f"train.run_dir={run_dir}", *overrides])
  result = Trainer(config, devices=ONE_DEVICE).fit(show_progress=False)
  print(f"  {name}: {steps} steps, loss {result.summary['first_loss']:.2f} -> {result.summary['final_loss']:.2f}",
        flush=True)
  return run_dir


def measured_tree(heads_run: Path, nodes: int, ranks: int = 4):
  """A tree of `nodes` grown from the heads' per-rank accuracies on the bundled held-out text."""
  run = open_run(heads_run, mesh={"fsdp": 1}, devices=ONE_DEVICE)
  accuracy = np.asarray(rank_accuracy(run.model, heldout_batch(run.tokenizer), ranks))
  print("  held-out accuracy by head (rows) and rank (columns):")
  for h, row in enumerate(accuracy):
    print(f"    head {h}: " + " ".join(f"{a:.2f}" for a in row))
  tree = choose_tree(accuracy, nodes)
  print(f"  tree of {nodes}: {tree.paths}", flush=True)
  return tree


def heldout_batch(tokenizer, seq_len: int = 128, windows: int = 16) -> dict:
  text = "\n\n".join(read_documents("bundled-heldout"))
  return jax.tree.map(jnp.asarray, window_batch(token_windows(text, tokenizer, seq_len, windows)))


def mtp_agreement(run_dir: Path) -> tuple[float, float]:
  """(top-1 accuracy of the MTP module's guess of t_{i+2} on held-out text, how often that
  guess is the model's own greedy token at i + 2 given the true text up to i + 1)."""
  run = open_run(run_dir, mesh={"fsdp": 1}, devices=ONE_DEVICE)
  tokens = heldout_batch(run.tokenizer)["inputs"]

  @jax.jit
  def guesses(tokens):
    model = run.runtime.merge(run.params, run.model_state)
    return jnp.argmax(model.mtp_forward(tokens), -1), jnp.argmax(model(tokens)[0], -1)
  mtp, greedy = (np.asarray(x) for x in guesses(tokens))
  return float(np.mean(mtp[:, :-1] == np.asarray(tokens)[:, 2:])), float(np.mean(mtp[:, :-1] == greedy[:, 1:-1]))


def compare(engines: dict, batch: int, settings):
  """One table row per engine and text: each engine's batch of prompts, timed."""
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
      rounds = engine.stats["speculative_calls"] or engine.stats["decode_steps"]  # the batch's target passes
      generated = sum(len(t) for t in tokens)
      print(f"{batch:>5} {text:>10} {name:>12} | {seconds:>8.2f} {generated / seconds:>7.0f} "
            f"{plain_s / seconds:>7.2f}x {(f'{kept / proposed:.0%}' if proposed else '-'):>8} "
            f"{generated / max(passes, 1):>8.2f} {1e3 * seconds / max(rounds, 1):>8.2f} "
            f"{str(tokens == want):>5}", flush=True)


HEADER = (f"{'batch':>5} {'text':>10} {'decoding':>12} | {'seconds':>8} {'tok/s':>7} {'speed-up':>8} "
          f"{'accepted':>8} {'tok/pass':>8} {'ms/round':>8} {'same':>5}")


def engine_options(batch: int) -> dict:
  return dict(mesh={"fsdp": 1}, devices=ONE_DEVICE, slots=batch, max_seq_len=256, page_size=16,
              prefill_chunks=(64,))


def mtp_part(args, root: Path):
  print(f"training {args.mtp_config} with its multi-token-prediction module:", flush=True)
  config = load_config(args.mtp_config)
  run = train(args.mtp_config, root, "mtp", args.mtp_steps, [f"train.learning_rate={config.train.learning_rate}"])
  accuracy, agreement = mtp_agreement(run)
  print(f"  held-out: the MTP guess of t+2 is right {accuracy:.1%} of the time and the model's own greedy "
        f"token {agreement:.1%}", flush=True)
  settings = SamplingParams(max_tokens=args.new, temperature=0.0, stop_token_ids=())
  print(f"\ngreedy, {args.new} new tokens, 1 CPU device\n\n{HEADER}")
  for batch in args.batches:
    options = engine_options(batch)
    compare({"plain": Engine.from_checkpoint(run, **options),
             "mtp k=1": Engine.from_checkpoint(run, **options, speculative=MtpDraft(1)),
             "mtp k=2": Engine.from_checkpoint(run, **options, speculative=MtpDraft(2))}, batch, settings)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="bench-50m")
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--head-steps", type=int, default=400)
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
  parser.add_argument("--new", type=int, default=96)
  parser.add_argument("--k", type=int, default=4)
  parser.add_argument("--tree", type=int, default=8)
  parser.add_argument("--runs", type=Path, help="where the trained runs go (default: a new temporary folder); "
                      "runs already there are used as they are")
  parser.add_argument("--part", choices=("all", "main", "mtp"), default="all")
  parser.add_argument("--mtp-config", default="tiny-deepseek")
  parser.add_argument("--mtp-steps", type=int, default=400)
  args = parser.parse_args()
  root = args.runs or Path(tempfile.mkdtemp(prefix="jaxpar-bench-spec-"))
  if args.part in ("all", "main"):
    main_part(args, root)
  if args.part in ("all", "mtp"):
    mtp_part(args, root)


def main_part(args, root: Path):
  print(f"training ({args.config} target, 1 x 64 draft, {args.k} Medusa heads):", flush=True)
  target = train(args.config, root, "target", args.steps)
  draft = train(args.config, root, "draft", args.steps, [
      "model.num_layers=1", "model.embed_dim=64", "model.mlp_dim=192", "model.num_heads=4", "model.num_kv_heads=4",
      "model.head_dim=16", "model.scan_unroll=1"])
  heads = train(args.config, root, "heads", args.head_steps, [
      "train.objective=medusa", f"model.medusa.heads={args.k}", "model.medusa.shared_projection=true",
      f"model.medusa.base={target}"])
  tree = measured_tree(heads, args.tree)
  settings = SamplingParams(max_tokens=args.new, temperature=0.0, stop_token_ids=())
  print(f"\ngreedy, {args.new} new tokens, k={args.k}, 1 CPU device\n\n{HEADER}")
  for batch in args.batches:
    options = engine_options(batch)
    sources = {
        "plain": lambda: Engine.from_checkpoint(target, **options),  # noqa: B023
        "draft model": lambda: Engine.from_checkpoint(target, **options, speculative=DraftModel(  # noqa: B023
            Engine.from_checkpoint(draft, **options, prefix_caching=False), args.k)),  # noqa: B023
        "n-gram": lambda: Engine.from_checkpoint(target, **options, speculative=NgramDraft(args.k)),  # noqa: B023
        "medusa": lambda: Engine.from_checkpoint(heads, **options, speculative=MedusaDraft(args.k)),  # noqa: B023
        "medusa tree": lambda: Engine.from_checkpoint(heads, **options, speculative=MedusaDraft(tree=tree)),
    }
    compare({name: make() for name, make in sources.items()}, batch, settings)


if __name__ == "__main__":
  main()
