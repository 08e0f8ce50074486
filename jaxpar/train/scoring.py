"""Log-likelihood of token continuations, batched: what an evaluation harness asks of a model.

A request is a token sequence and how many of its last tokens to score, each given all the
tokens before it. Requests run `batch_size` rows at a time, right-padded to the shortest of
a few bucket lengths, through one compiled forward pass per bucket (compiled on first use):
each position gives log p(next token) and whether that token was the most likely one.
Padding sits after a row's tokens, so under causal attention it changes nothing they see.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.mesh import logical_to_sharding, num_shards

BUCKETS = (64, 256, 1024, 4096)


def _score(model, inputs, targets):
  """(log p(target), target is the argmax) per position, in float32."""
  logits, _ = model(inputs)
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  # A one-hot product rather than a gather keeps a vocabulary-split logits array split.
  target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1)
  return target_logit - log_z, target_logit >= jnp.max(logits, axis=-1)


class Scorer:
  """Scores requests on a loaded model: runtime (mesh, rules), params, model_state."""

  def __init__(self, runtime, params, model_state=None, *, batch_size: int = 8, max_len: int | None = None):
    self.runtime, self.params, self.model_state = runtime, params, model_state or {}
    self.max_len = max_len or runtime.model_config.max_seq_len
    shards = num_shards("batch", runtime.mesh, runtime.rules)
    self.batch_size = -(-batch_size // shards) * shards  # every batch shard gets whole rows
    self.buckets = sorted({b for b in BUCKETS if b < self.max_len} | {self.max_len})
    rows = logical_to_sharding(("batch", "length"), None, runtime.mesh, runtime.rules)
    self._forward = jax.jit(lambda p, s, x, y: _score(runtime.merge(p, s), x, y),
                            in_shardings=(runtime.param_shardings, runtime.model_state_shardings, rows, rows))

  def score(self, requests: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
    """For each (tokens, count): the summed log-probability of the last `count` tokens, and
    whether greedy decoding would have produced all of them. A sequence longer than the
    model's context keeps its last max_len + 1 tokens."""
    rows = []
    for tokens, count in requests:
      tokens = list(tokens)[-(self.max_len + 1):]
      if not 0 < count < len(tokens):
        raise ValueError(f"cannot score the last {count} of {len(tokens)} tokens: give a context token")
      rows.append((tokens, count))
    results = [None] * len(rows)
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths batch together
    for start in range(0, len(order), self.batch_size):
      chosen = order[start:start + self.batch_size]
      length = next(b for b in self.buckets if b >= len(rows[chosen[0]][0]) - 1)
      inputs = np.zeros((self.batch_size, length), np.int32)
      targets = np.zeros((self.batch_size, length), np.int32)
      for r, i in enumerate(chosen):
        tokens = rows[i][0]
        inputs[r, :len(tokens) - 1], targets[r, :len(tokens) - 1] = tokens[:-1], tokens[1:]
      with self.runtime.context():
        logp, greedy = jax.device_get(self._forward(self.params, self.model_state, inputs, targets))
      for r, i in enumerate(chosen):
        tokens, count = rows[i]
        scored = slice(len(tokens) - 1 - count, len(tokens) - 1)
        results[i] = (float(np.sum(logp[r, scored], dtype=np.float64)), bool(np.all(greedy[r, scored])))
    return results
