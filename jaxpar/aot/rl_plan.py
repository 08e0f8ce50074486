"""`jaxpar compile` of a reinforcement-learning config (train.objective: grpo): whether the
train step and the rollout engine fit one TPU slice together, collocated as jaxpar runs
them, and the largest rollout batch that does.

Collocated, the engine decodes with the policy's own arrays (no copy) and keeps its KV pages
between rollouts (jaxpar/rl/rollouts.py), so per chip, from the compiled programs:

  training   the train step (parameters, optimizer state, the reference, the batch and its
             temporaries) + the engine's KV pages
  rollouts   the decode step (the policy's parameters, the KV pages and its temporaries)
             + the optimizer state and the reference, resident meanwhile

The engine computes in the model's compute dtype on the policy's arrays and keeps its KV
pages in that dtype (bfloat16 for a bf16-compute recipe over f32 master weights). The slice
fits when both do. A rollout batch is data.global_batch_size completions of up to
data.seq_len + 1 tokens, decoded together; it is also the train step's batch. Both programs'
bytes grow linearly with it: compiled at the configured batch and twice it, the largest
batch (a multiple of objective.group_size) both phases hold follows, and is compiled to check
(where twice does not compile within HBM, the configured batch stands; where the configured
one does not, it is halved until one fits). A program that does not fit HBM is a phase that
does not fit, not an error.
"""

from jaxpar.aot.compile import compile_for_topology
from jaxpar.aot.inference import compile_inference
from jaxpar.aot.phases import silent
from jaxpar.aot.report import gib
from jaxpar.config import replace

PAGE_SIZE = 16  # the rollout engine's


def _phases(config, topology, batch: int, phase, trained=None) -> dict:
  """Per-chip bytes of both phases at a rollout batch of `batch` completions; `trained`: the
  train step's (report, compiled executable) at that batch, when already compiled."""
  config = replace(config, data={"global_batch_size": batch})
  train, compiled = trained or compile_for_topology(config, topology, phase=phase)
  decode = compile_inference(config, topology, slots=batch, context=config.data.seq_len + 1, page_size=PAGE_SIZE,
                             chunk=None, param_dtype=config.model.param_dtype,
                             compute_dtype=config.model.compute_dtype, phase=phase)
  state = train["state_bytes"]
  step = decode["programs"]["decode"]
  out = {"batch": batch, "hbm_bytes": train["hbm_bytes"], "chip": train["chip"], "devices": train["devices"],
         "params": state["params"], "opt_state": state["opt_state"], "reference": state["frozen"],
         "kv_pages": decode["cache_bytes"], "decode_temporaries": step.get("temporaries", float("inf")),
         "train_fits": compiled is not None}
  out["training"] = (train["memory"]["total"] if compiled is not None else float("inf")) + out["kv_pages"]
  # A decode step that does not compile within HBM: the rollouts do not fit at this batch.
  out["rollouts"] = step["total"] + state["opt_state"] + state["frozen"] if "oom" not in step else float("inf")
  out["fits"] = out["train_fits"] and max(out["training"], out["rollouts"]) <= out["hbm_bytes"]
  return out


def plan_rollouts(config, topology: str, most: int = 1024, phase=silent, trained=None) -> dict:
  """{"configured": phases at data.global_batch_size, "largest": the largest rollout batch up
  to `most` that both phases fit (its phases, compiled), or None when not even one group
  does; "capped": whether `most` fits (a larger batch might too)}. `trained`: the train
  step as configured, (report, compiled), when `jaxpar compile` has it already."""
  group = config.objective.group_size
  batch = config.data.global_batch_size
  measured = {batch: _phases(config, topology, batch, phase, trained)}

  def phases(size):  # each batch size compiled once
    if size not in measured:
      measured[size] = _phases(config, topology, size, phase)
    return measured[size]
  at = phases(batch)
  hbm, estimate = at["hbm_bytes"], float(most)
  if not at["fits"]:  # halve the batch until one fits (or not even one group does)
    size = batch // 2 // group * group
    while size >= group and not phases(size)["fits"]:
      size = size // 2 // group * group
    estimate = size
  else:
    twice = phases(2 * batch)
    for name in ("training", "rollouts"):
      if twice[name] == float("inf"):  # twice does not compile within HBM: stay at what does
        estimate = min(estimate, batch)
      elif (slope := (twice[name] - at[name]) / batch) > 0:
        estimate = min(estimate, batch + (hbm - at[name]) / slope)
  largest = int(estimate) // group * group
  checked = phases(largest) if largest >= group else None
  for _ in range(4):  # the bytes were a straight line; where they bend, step down a tenth at a time
    if checked is None or checked["fits"] or checked["batch"] <= group:
      break
    checked = phases(max(group, int(checked["batch"] * 0.9) // group * group))
  largest = checked if checked is not None and checked["fits"] else None
  return {"topology": topology, "configured": at, "largest": largest,
          "capped": largest is not None and largest["batch"] >= most}


def format_rollout_plan(plan: dict) -> str:
  at = plan["configured"]
  lines = [f"reinforcement learning, collocated on {plan['topology']} ({at['devices']} {at['chip']} chips), "
           "per chip:",
           f"  resident: policy {gib(at['params'])}, optimizer state {gib(at['opt_state'])}, "
           f"reference {gib(at['reference'])}"]
  size = lambda x: gib(x) if x != float("inf") else "more than HBM (its program does not compile)"  # noqa: E731
  for row in (at, plan["largest"]):
    if row is None:
      continue
    verdict = "FITS" if row["fits"] else "DOES NOT FIT"
    lines.append(f"  rollout batch {row['batch']}: {verdict}; training {size(row['training'])}, rollouts "
                 f"{size(row['rollouts'])} (KV pages {gib(row['kv_pages'])}, decode temporaries "
                 f"{size(row['decode_temporaries'])}) of {gib(row['hbm_bytes'])} HBM")
  largest = plan["largest"]
  if largest is None:
    lines.append("no rollout batch of one group fits: a larger slice, LoRA (model.lora) or a smaller model")
  elif not at["fits"]:
    lines.append(f"largest rollout batch that fits, halving the configured one: {largest['batch']}")
  else:
    lines.append(f"largest rollout batch that fits: {largest['batch']}"
                 + (" (the most this plan tries; larger ones may fit too)" if plan["capped"] else ""))
  return "\n".join(lines)
