"""Causal language-model loss over packed sequences, with optional z-loss."""

import jax
import jax.numpy as jnp


def causal_lm_loss(logits, targets, loss_mask, z_loss: float = 0.0):
  """Summed (not averaged) so microbatches add up exactly.

  Returns (objective_sum, {"ce_sum", "z_sum", "tokens"}). The target logit is picked with a
  one-hot product rather than a gather so a vocab-sharded logits array stays sharded.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1)
  mask = loss_mask.astype(jnp.float32)
  ce_sum = jnp.sum((log_z - target_logit) * mask)
  # z-loss (PaLM) keeps log Z near 0, which stabilises large-scale bf16 training.
  z_sum = z_loss * jnp.sum(jnp.square(log_z) * mask)
  return ce_sum + z_sum, {"ce_sum": ce_sum, "z_sum": z_sum, "tokens": jnp.sum(mask)}
