"""One training step: loss, gradients (optionally accumulated over microbatches), update."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.loss import causal_lm_loss, fused_lm_loss


def _split_microbatches(batch, count: int):
  """[B, ...] -> [count, B / count, ...], taking rows with stride `count` so each
  microbatch keeps the batch sharding of the whole."""
  def split(x):
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def make_gradients(graphdef, *, z_loss: float, microbatches: int, logits_chunk_len: int = 0):
  """(params, batch) -> (summed grads, {"ce_sum", "z_sum", "tokens"}).

  logits_chunk_len > 0: the fused chunked loss (never holds all logits); 0: plain logits.
  """
  def loss_of(params, batch):
    model = nnx.merge(graphdef, params)
    inputs = (batch["inputs"], batch["positions"], batch["segment_ids"])
    if logits_chunk_len:
      return fused_lm_loss(model.hidden_states(*inputs), model.output_projection(), batch["targets"],
                           batch["loss_mask"], z_loss, logits_chunk_len)
    return causal_lm_loss(model(*inputs), batch["targets"], batch["loss_mask"], z_loss)

  grad_fn = jax.value_and_grad(loss_of, has_aux=True)

  def gradients(params, batch):
    if microbatches == 1:
      (_, aux), grads = grad_fn(params, batch)
      return grads, aux

    def accumulate(carry, microbatch):
      (_, aux), grads = grad_fn(params, microbatch)
      return jax.tree.map(jnp.add, carry, (grads, aux)), None

    zeros = jax.tree.map(jnp.zeros_like, params), {"ce_sum": 0.0, "z_sum": 0.0, "tokens": 0.0}
    (grads, aux), _ = jax.lax.scan(accumulate, zeros, _split_microbatches(batch, microbatches))
    return grads, aux

  return gradients


def make_train_step(graphdef, optimizer, schedule, *, z_loss: float, microbatches: int,
                    logits_chunk_len: int):
  gradients = make_gradients(graphdef, z_loss=z_loss, microbatches=microbatches,
                             logits_chunk_len=logits_chunk_len)

  def train_step(state, batch):
    params = state["params"]
    grads, aux = gradients(params, batch)
    tokens = jnp.maximum(aux["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                 "opt_state": opt_state}
    metrics = {"loss": aux["ce_sum"] / tokens, "z_loss": aux["z_sum"] / tokens,
               "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"]),
               "tokens": aux["tokens"]}
    return new_state, metrics

  return train_step
