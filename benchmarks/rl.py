"""Reinforcement learning's phases on CPU: rollout and train tokens/s, the share of each step
in rollouts, weight sync and the update, collocated against split devices, and the bytes a
sync moves with full weights against LoRA adapters.

    python benchmarks/rl.py [--steps 4]

8 simulated CPU devices; GRPO over the bundled arithmetic prompts (ChatML, byte tokens), 4
prompts x 8 samples of up to 32 tokens per step, random-init models (every completion runs to
max_tokens). Shapes: the tiny chat model (0.85M) and bench-20m's (vocabulary 32000).
Collocated: rollouts and training in turn on all 8 devices (FSDP 8), the engine in the
trainer's layout or data parallel (objective.rollout_mesh, resharded at each sync). Split:
rollouts on 4 devices (data parallel), training on the other 4 (FSDP 4), in turn.
Off-policy: split, rollouts one update ahead in a thread (objective.max_staleness=1).
"waiting": the share of each step the trainer spent waiting for rollouts (drawing them,
when on-policy); train tok/s: tokens over the rest of the step.
Times are the mean over the steps after the first (which compiles). The 8 "devices" share
this host's cores: split and off-policy here measure the bookkeeping, not the speed-up two
real device groups give.
"""

import argparse
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from jaxpar.config import load_config  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

SHAPES = {"tiny": [], "bench-20m": ["model.vocab_size=32000", "model.embed_dim=256", "model.num_layers=4",
                                    "model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=64",
                                    "model.mlp_dim=1024", "model.max_seq_len=256"]}
LAYOUTS = {"collocated": ["mesh.fsdp=8"],
           "collocated, DP engine": ["mesh.fsdp=8", "objective.rollout_mesh={fsdp: 1, data: -1}"],
           "split": ["mesh.fsdp=-1", "objective.rollout_devices=4"],
           "off-policy": ["mesh.fsdp=-1", "objective.rollout_devices=4", "objective.max_staleness=1"]}
LORA = ["model.lora.rank=8", "model.lora.alpha=16", "model.lora.targets=[q,k,v,o,gate,up,down]"]


def run(shape, layout, extra, steps) -> dict:
  overrides = [*SHAPES[shape], *LAYOUTS[layout], *extra, "objective.reference=null", "objective.eval_every=0",
               "data.global_batch_size=32", f"train.steps={steps + 1}", "checkpoint.enabled=false",
               f"train.run_dir={tempfile.mkdtemp()}", "train.log_every=0"]
  config = load_config("grpo-tiny", overrides)
  result = Trainer(config).fit(show_progress=False)
  timed = result.history[1:]
  mean = lambda key: sum(h.get(key, 0.0) for h in timed) / len(timed)  # noqa: E731
  step, sync = mean("step_time_s"), mean("sync_s")
  waiting = mean("rollout_wait_s") if "rollout_wait_s" in timed[0] else mean("rollout_s")
  tokens = config.data.global_batch_size * config.data.seq_len
  return {"step": step, "waiting": waiting, "sync": sync, "bytes": mean("sync_bytes"),
          "rollout_tps": mean("rollout_tokens_per_s"), "train_tps": tokens / (step - waiting - sync)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=4)
  args = parser.parse_args()
  print("| shape | layout | weights | step s | waiting | sync | rollout tok/s | train tok/s | sync bytes |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  rows = [(shape, layout, "full", []) for shape in SHAPES for layout in LAYOUTS]
  rows += [("tiny", layout, "LoRA r8", LORA) for layout in ("collocated", "split", "off-policy")]
  for shape, layout, weights, extra in rows:
    r = run(shape, layout, extra, args.steps)
    print(f"| {shape} | {layout} | {weights} | {r['step']:.2f} | {r['waiting'] / r['step']:.0%} | "
          f"{r['sync'] / r['step']:.1%} | {r['rollout_tps']:,.0f} | {r['train_tps']:,.0f} | {r['bytes']:,.0f} |",
          flush=True)


if __name__ == "__main__":
  main()
