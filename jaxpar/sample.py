"""Greedy sampling for a quick look at a trained model (the inference engine is separate).

No KV cache: each new token reruns the model on a fixed-size buffer, so one compiled
program serves every step. Fine for a short sample from a small model. On a mesh that
splits the sequence (context or sequence parallelism) the buffer is padded to a length
that splits evenly; causal attention keeps the padding out of the tokens before it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.mesh import num_shards


def greedy_sample(graphdef, params, tokenizer, prompt: str, num_tokens: int, max_len: int) -> str:
  prompt_ids = tokenizer.encode(prompt)[-max_len + num_tokens:] if num_tokens < max_len else []
  length = min(len(prompt_ids) + num_tokens, max_len)
  shards = num_shards("residual_length")
  buffer = np.zeros((1, -(-length // shards) * shards), np.int32)
  buffer[0, :len(prompt_ids)] = prompt_ids

  @jax.jit
  def next_token(params, tokens, position):
    logits, _ = nnx.merge(graphdef, params)(tokens)
    return jnp.argmax(logits[0, position - 1]).astype(jnp.int32)

  tokens = jnp.asarray(buffer)
  for position in range(len(prompt_ids), length):
    token = next_token(params, tokens, position)
    tokens = tokens.at[0, position].set(token)
  return tokenizer.decode(np.asarray(tokens[0, len(prompt_ids):length]).tolist())
