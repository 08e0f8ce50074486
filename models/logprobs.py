"""The log-probability of chosen tokens under logits: one function for every side that needs
it (the sampler's reported log-probs, DPO's answer scores, reinforcement learning's policy
ratio), so a sampler and a trainer that see the same logits give the same numbers."""

import jax
import jax.numpy as jnp


def token_logprobs(logits, tokens):
  """logits [..., V], tokens [...] -> log softmax(logits)[tokens] [...] in float32.

  A one-hot product, not a gather, so logits sharded over the vocabulary stay sharded."""
  logits = logits.astype(jnp.float32)
  chosen = jnp.sum(logits * jax.nn.one_hot(tokens, logits.shape[-1], dtype=logits.dtype), axis=-1)
  return chosen - jax.nn.logsumexp(logits, axis=-1)
