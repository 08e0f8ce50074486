"""One training step: objective, gradients (optionally accumulated over microbatches), update.

The objective is cross-entropy + z-loss + the model's auxiliary losses. Everything a
microbatch reports is a token-weighted sum (`sums`), so accumulation is a plain tree sum
and the step divides by the token count once, whatever keys the model adds. When the mesh
splits the sequence (context parallelism), the step puts each batch in zig-zag order once,
before the model: every array of the batch moves together, and the sums do not depend
on the order.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.finetune.partition import join
from jaxpar.train.loss import causal_lm_loss, fused_lm_loss
from jaxpar.mesh import num_shards
from jaxpar.pallas_kernels import zigzag
from jaxpar.train.state import TrainState


def _split_microbatches(batch, count: int):
  """[B, ...] -> [count, B / count, ...], taking rows with stride `count` so each
  microbatch keeps the batch sharding of the whole."""
  def split(x):
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def make_objective(graphdef, *, z_loss: float, logits_chunk_len: int = 0, load_balance: bool = True):
  """(params, model_state, batch, frozen=None) -> (objective, (sums, new model_state)): what
  training differentiates and evaluation reports. `frozen`: weights the model needs that are
  not differentiated (the base under adapters, TrainState.frozen).

  sums: {"ce_sum", "z_sum", "tokens"} plus, for each auxiliary loss or metric the model
  returns, its value x tokens under "loss/NAME" or "metric/NAME".
  logits_chunk_len > 0: the fused chunked loss (never holds all logits); 0: plain logits.
  load_balance: zig-zag order over the devices that split the length (if any).
  """
  def objective(params, model_state, batch, frozen=None):
    model = nnx.merge(graphdef, join(params, frozen) if frozen else params, model_state)
    shards = num_shards("length")
    balanced = load_balance and shards > 1
    if balanced:
      batch = jax.tree.map(lambda x: zigzag(x, shards), batch)
    inputs = (batch["inputs"], batch["positions"], batch["segment_ids"])
    if logits_chunk_len:
      hidden, aux = model.hidden_states(*inputs, zigzag=balanced)
      total, sums = fused_lm_loss(hidden, model.output_projection(), batch["targets"],
                                  batch["loss_mask"], z_loss, logits_chunk_len, model.cfg.final_logit_soft_cap)
    else:
      logits, aux = model(*inputs, zigzag=balanced)
      total, sums = causal_lm_loss(logits, batch["targets"], batch["loss_mask"], z_loss)
    tokens = sums["tokens"]
    for name, value in aux["losses"].items():
      total = total + tokens * value
      sums[f"loss/{name}"] = tokens * value
    for name, value in aux["metrics"].items():
      sums[f"metric/{name}"] = tokens * value
    return total, (sums, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))))

  return objective


def make_gradients(graphdef, *, z_loss: float, microbatches: int, logits_chunk_len: int = 0,
                   load_balance: bool = True, objective=None):
  """(params, batch, model_state, frozen) -> (summed grads of params, sums, new model_state);
  `make_objective` says what the sums hold. `objective`: another with the same contract
  (DPO's, jaxpar/finetune/dpo.py) instead of the language-model loss."""
  objective = objective or make_objective(graphdef, z_loss=z_loss, logits_chunk_len=logits_chunk_len,
                                          load_balance=load_balance)
  grad_fn = jax.grad(objective, has_aux=True)

  def gradients(params, batch, model_state=None, frozen=None):
    model_state = {} if model_state is None else model_state
    if microbatches == 1:
      grads, (sums, model_state) = grad_fn(params, model_state, batch, frozen)
      return grads, sums, model_state

    def accumulate(carry, microbatch):
      grads, sums, model_state = carry
      g, (s, model_state) = grad_fn(params, model_state, microbatch, frozen)
      return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s), model_state), None

    micro = _split_microbatches(batch, microbatches)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(grad_fn, params, model_state, first, frozen)[1][0]
    zeros = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, shapes), model_state)
    (grads, sums, model_state), _ = jax.lax.scan(accumulate, zeros, micro)
    return grads, sums, model_state

  return gradients


def make_train_step(graphdef, optimizer, schedule, *, z_loss: float, microbatches: int,
                    logits_chunk_len: int, load_balance: bool = True, objective=None):
  gradients = make_gradients(graphdef, z_loss=z_loss, microbatches=microbatches,
                             logits_chunk_len=logits_chunk_len, load_balance=load_balance, objective=objective)

  def train_step(state: TrainState, batch):
    grads, sums, model_state = gradients(state.params, batch, state.model_state, state.frozen)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_state = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                           opt_state=opt_state, model_state=model_state, frozen=state.frozen)
    metrics = {"loss": sums["ce_sum"] / tokens, "z_loss": sums["z_sum"] / tokens,
               "grad_norm": optax.tree.norm(grads), "lr": schedule(state.step),
               "tokens": sums["tokens"]}
    metrics.update({k.split("/", 1)[1] if k.startswith("metric/") else k: v / tokens
                    for k, v in sums.items() if "/" in k})
    return new_state, metrics

  return train_step
