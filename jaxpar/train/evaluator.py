"""Evaluation on held-out text: loss, perplexity and bits per byte of named eval sets.

The eval step is the language-model loss without gradients (objectives/lm.py: lm_loss), jitted
once with the train step's shardings (parameters, model state, batch), so it runs on every
mesh and parallelism the train step does, and a checkpoint evaluated on its own mesh gives
the number training logged at that step. Each set is read in order (EvalBatches), the same
windows every time: `eval.steps` batches, or the whole set.

  loss            mean next-token cross-entropy, nats
  perplexity      exp(loss)
  bits_per_byte   summed cross-entropy / ln 2 / the UTF-8 bytes of the predicted text:
                  comparable across tokenizers (data/token_bytes.py)
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.data import EvalBatches, byte_lengths, eval_streams
from jaxpar.objectives.lm import lm_loss

_SUMS = ("ce_sum", "tokens", "bytes")


def make_eval_step(graphdef, *, logits_chunk_len: int = 0, load_balance: bool = True, kv_quantization=None):
  """(params, model_state, batch) -> {"ce_sum", "tokens", "bytes"} over the batch (no
  "target_bytes" in the batch: bytes 0); kv_quantization: attending as through that cache."""
  objective = lm_loss(graphdef, z_loss=0.0, logits_chunk_len=logits_chunk_len, load_balance=load_balance,
                      kv_quantization=kv_quantization)

  def eval_step(params, model_state, batch):
    _, (sums, _) = objective(params, model_state, batch)
    return {"ce_sum": sums["ce_sum"], "tokens": sums["tokens"],
            "bytes": jnp.sum(batch.get("target_bytes", jnp.zeros(())).astype(jnp.float32))}
  return eval_step


def jit_eval_step(runtime, logits_chunk_len: int, params_sharding, model_state_sharding, batch_sharding):
  """The eval step jitted with the train step's shardings: build it once per mesh and reuse it."""
  step = make_eval_step(runtime.graphdef, logits_chunk_len=logits_chunk_len,
                        load_balance=runtime.plan.load_balance)
  batch = {k: batch_sharding for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask",
                                       "target_bytes")}
  return jax.jit(step, in_shardings=(params_sharding, model_state_sharding, batch))


def summarize(sums: dict) -> dict:
  """Summed cross-entropy, tokens and bytes -> loss, perplexity, bits per byte."""
  loss = sums["ce_sum"] / max(sums["tokens"], 1.0)
  return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
          "bits_per_byte": sums["ce_sum"] / math.log(2) / max(sums["bytes"], 1.0), "tokens": sums["tokens"]}


class Evaluator:
  """The config's eval sets (or `names`: set names, source names or paths) on a runtime.

  params_sharding, model_state_sharding, batch_sharding: the train step's. `sources`: data
  sources already opened (the training loader's), so nothing is read or tokenized twice;
  `step`: a `jit_eval_step` already built for these shardings (the trainer keeps one).
  """

  def __init__(self, config, runtime, tokenizer, params_sharding, model_state_sharding, batch_sharding, *,
               names=None, sources=None, steps=None, batch_size=None, step=None):
    e, d = config.eval, config.data
    self.batch_size = batch_size or e.batch_size or d.global_batch_size
    table = byte_lengths(tokenizer)
    self.sets = {name: EvalBatches(stream, d.seq_len, self.batch_size, table, batch_sharding,
                                   steps=steps or e.steps)
                 for name, stream in eval_streams(config, tokenizer, names, sources).items()}
    self.runtime = runtime
    self._step = step or jit_eval_step(runtime, config.train.logits_chunk_len, params_sharding,
                                       model_state_sharding, batch_sharding)

  def run(self, params, model_state=None, progress=None) -> dict[str, dict]:
    """{set name: {"loss", "perplexity", "bits_per_byte", "tokens"}}. `progress(name, done,
    total)` is called as each batch's sums come back."""
    model_state = model_state if model_state is not None else {}
    results = {}
    with self.runtime.context():
      for name, batches in self.sets.items():
        pending = [self._step(params, model_state, batch) for batch in batches]
        done = []
        for sums in pending:  # dispatched ahead; read in order
          done.append(jax.device_get(sums))
          if progress is not None:
            progress(name, len(done), len(pending))
        totals = {k: float(sum(d[k] for d in done)) for k in _SUMS}
        results[name] = summarize(totals)
    return results


def flat_metrics(results: dict) -> dict[str, float]:
  """{"eval/NAME/loss": ..., ...}: how results go into metrics records."""
  return {f"eval/{name}/{key}": value for name, r in results.items() for key, value in r.items()}


def perplexity(runtime, params, windows, *, batch_size: int = 8, kv_quantization=None) -> float:
  """exp(mean next-token cross-entropy) of the model over held-out `windows` [N, L + 1]
  (data/heldout.py), by the same eval step as the named sets; kv_quantization (a
  kv_quant.KVQuantization): attending as through that quantized KV cache."""
  step = jax.jit(make_eval_step(runtime.graphdef, kv_quantization=kv_quantization))
  totals = {"ce_sum": 0.0, "tokens": 0.0}
  with runtime.context():
    for start in range(0, len(windows), batch_size):
      rows = windows[start:start + batch_size]
      # Unpacked windows: no segments, a token's position is its index (as a cache holds them).
      batch = {"inputs": rows[:, :-1], "targets": rows[:, 1:], "segment_ids": None, "positions": None,
               "loss_mask": np.ones(rows[:, 1:].shape, np.float32)}
      sums = step(params, {}, batch)
      totals = {k: totals[k] + float(sums[k]) for k in totals}
  return math.exp(totals["ce_sum"] / totals["tokens"])
