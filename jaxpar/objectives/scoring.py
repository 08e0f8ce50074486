"""A model's log-probability of each target token of a batch, and the entropy at each position:
what preference and reinforcement-learning losses score sequences with.

With `chunk_len` > 0 the logits are made `chunk_len` positions at a time and remade in the
backward pass, so the [rows, length, vocab] logits never exist at once: with a 152k
vocabulary, 16 rows of 1024 positions hold 10 GiB of float32 logits, more than the rest of a
1.7B model's train step. Each chunk's logits are the model's own (`model.logits`), so the
numbers are those of the whole-sequence forward.
"""

import jax
import jax.numpy as jnp

from jaxpar.mesh import constrain
from jaxpar.models.logprobs import token_logprobs
from jaxpar.train.loss import chunk_length

_LOGITS = ("batch", "length", "act_vocab")


def entropy(logits):
  """[..., vocab] -> [...] entropy of each position's distribution (a metric: no gradient)."""
  logp = jax.nn.log_softmax(jax.lax.stop_gradient(logits).astype(jnp.float32), axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def sequence_logprobs(model, batch, chunk_len: int = 0):
  """([rows, length] log-probability of each target token under `model` (f32), [rows, length]
  entropy of each position (no gradient))."""
  inputs = (batch["inputs"], batch["positions"], batch["segment_ids"])
  if not chunk_len:
    logits, _ = model(*inputs)
    return token_logprobs(logits, batch["targets"]), entropy(logits)
  hidden, _ = model.hidden_states(*inputs)
  rows, length, _ = hidden.shape
  chunk = chunk_length(length, chunk_len)

  @jax.checkpoint  # the backward pass remakes the chunk's logits instead of keeping them
  def score(pieces):
    h, targets = pieces
    logits = constrain(model.logits(h), _LOGITS)
    return token_logprobs(logits, targets), entropy(logits)

  chunks = lambda x: jnp.moveaxis(x.reshape(rows, length // chunk, chunk, *x.shape[2:]), 1, 0)  # noqa: E731
  logp, spread = jax.lax.map(score, (chunks(hidden), chunks(batch["targets"])))
  whole = lambda x: jnp.moveaxis(x, 0, 1).reshape(rows, length)  # noqa: E731
  return whole(logp), whole(spread)
