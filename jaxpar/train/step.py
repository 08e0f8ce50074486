"""One training step: an objective's loss, gradients (optionally accumulated over microbatches),
update. Everything a microbatch reports is a summed value (`sums`), so accumulation is a
plain tree sum and the step divides by the token count once, whatever keys the objective
or the model add.
"""

import jax
import jax.numpy as jnp
import optax

from jaxpar.models import low_precision
from jaxpar.train import amax_histories
from jaxpar.train.state import TrainState
from jaxpar.trees import join


def _split_microbatches(batch, count: int):
  """[B, ...] -> [count, B / count, ...], taking rows with stride `count` so each
  microbatch keeps the batch sharding of the whole."""
  def split(x):
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def _differentiating_histories(loss):
  """jax.grad of `loss` that also takes fp8_delayed's scaling histories (model_state's
  AmaxHistory leaves) as an input, whose cotangent carries the gradients' maxima, and writes
  those into the new model_state (amax_histories.py)."""
  grad_fn = jax.grad(lambda params, histories, rest, batch, frozen: loss(params, join(rest, histories), batch, frozen),
                     argnums=(0, 1), has_aux=True)

  def gradients(params, model_state, batch, frozen):
    histories, rest = amax_histories.split_histories(model_state)
    (grads, maxima), (sums, model_state) = grad_fn(params, histories, rest, batch, frozen)
    return grads, (sums, amax_histories.record_gradient_maxima(model_state, maxima))
  return gradients


def make_gradients(loss, *, microbatches: int):
  """(params, batch, model_state, frozen) -> (summed grads of params, sums, new model_state) of
  an objective's `loss` (jaxpar/objectives/base.py says what it returns)."""
  grad_fn = _differentiating_histories(loss)

  def gradients(params, batch, model_state=None, frozen=None):
    model_state = {} if model_state is None else model_state
    if microbatches == 1:
      grads, (sums, model_state) = grad_fn(params, model_state, batch, frozen)
      return grads, sums, model_state

    def accumulate(carry, numbered):
      grads, sums, model_state = carry
      number, microbatch = numbered
      with low_precision.noise_scope(number):  # each microbatch its own gradient rounding noise
        g, (s, model_state) = grad_fn(params, model_state, microbatch, frozen)
      return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s), model_state), None

    micro = _split_microbatches(batch, microbatches)
    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(grad_fn, params, model_state, first, frozen)[1][0]
    zeros = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, shapes), model_state)
    (grads, sums, model_state), _ = jax.lax.scan(accumulate, zeros, (jnp.arange(microbatches), micro))
    return grads, sums, model_state

  return gradients


def make_update(loss, optimizer, schedule, *, microbatches: int, host_optimizer=None):
  """(params, opt_state, model_state, frozen, step, batch) -> (params, opt_state, model_state,
  metrics): one optimizer step on one batch, the body of every train step (a replica's too:
  jaxpar/train/replicas/). host_optimizer: a train/offload.py HostOptimizer that runs the
  update on the host (train.offload_optimizer=host), or None."""
  gradients = make_gradients(loss, microbatches=microbatches)

  def update(params, opt_state, model_state, frozen, step, batch):
    # model.train_precision=int8_stochastic rounds gradients with noise of this step's own.
    with low_precision.rounding_noise(jax.random.fold_in(jax.random.key(0), step)):
      grads, sums, model_state = gradients(params, batch, model_state, frozen)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)
    if host_optimizer is None:
      updates, opt_state = optimizer.update(grads, opt_state, params)
    else:
      updates, opt_state = host_optimizer.update(grads, opt_state, params)
    metrics = {"loss": sums["ce_sum"] / tokens, "z_loss": sums["z_sum"] / tokens,
               "grad_norm": optax.tree.norm(grads), "lr": schedule(step),
               "tokens": sums["tokens"]}
    metrics.update({k.split("/", 1)[1] if k.startswith("metric/") else k: v / tokens
                    for k, v in sums.items() if "/" in k})
    return optax.apply_updates(params, updates), opt_state, model_state, metrics

  return update


def make_train_step(loss, optimizer, schedule, *, microbatches: int, host_optimizer=None):
  update = make_update(loss, optimizer, schedule, microbatches=microbatches, host_optimizer=host_optimizer)

  def train_step(state: TrainState, batch):
    params, opt_state, model_state, metrics = update(state.params, state.opt_state, state.model_state,
                                                     state.frozen, state.step, batch)
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state,
                           frozen=state.frozen)
    return new_state, metrics

  return train_step
