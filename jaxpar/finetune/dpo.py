"""Direct Preference Optimization (DPO, Rafailov et al. 2023) over adapters.

For a prompt x with a chosen answer y_w and a rejected one y_l, and log-probabilities summed
over each answer's tokens under the policy (pi) and a frozen reference (ref):

  margin = beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x)))
  loss   = -log sigmoid(margin)

The reference is the base model with the adapters off (model.lora: all adapter weights
zero, so no second copy of the base is held), run in the same step under stop_gradient:
one more forward pass per step instead of a pass over the data before training, so the
data order, the mesh and resumption stay as for any run. Metrics per pair: `loss`,
`reward_margin` (the margin above), `reward_accuracy` (the share of pairs with margin > 0),
`chosen_reward` and `rejected_reward` (beta * the policy-minus-reference log-ratio of each).

beta -> 0: margin -> 0, so the loss -> ln 2 at every step and its gradient (which is
-beta * sigmoid(-margin) * d/dθ[log-ratio difference]) shrinks in proportion to beta: a
small beta lets the policy drift far from the reference before the loss saturates, a large
one keeps it close.

A batch holds data.global_batch_size pairs as twice as many rows: every chosen answer
first, then the rejected ones in the same order (DPOBatches).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.finetune.partition import join


def answer_logprobs(model, batch):
  """[rows] log-probability of each row's masked target tokens (the answer), summed."""
  logits, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  # A one-hot product, not a gather, so a vocab-sharded logits array stays sharded (loss.py).
  target = jnp.sum(logits * jax.nn.one_hot(batch["targets"], logits.shape[-1], dtype=logits.dtype), -1)
  return jnp.sum((target - log_z) * batch["loss_mask"].astype(jnp.float32), axis=-1)


def dpo_loss(policy, reference, beta: float):
  """policy, reference: [2 * pairs] answer log-probs (chosen rows, then rejected) ->
  (loss [pairs], margin [pairs], chosen reward [pairs], rejected reward [pairs])."""
  pairs = policy.shape[0] // 2
  ratio = beta * (policy - reference)
  chosen, rejected = ratio[:pairs], ratio[pairs:]
  margin = chosen - rejected
  return -jax.nn.log_sigmoid(margin), margin, chosen, rejected


def make_dpo_objective(graphdef, beta: float):
  """(adapters, model_state, batch, frozen base) -> (summed loss, (sums, model_state)), as
  step.make_objective's contract: the step divides the sums by "tokens", here the pairs."""
  def objective(params, model_state, batch, frozen=None):
    model = nnx.merge(graphdef, join(params, frozen), model_state)
    policy = answer_logprobs(model, batch)
    adapters_off = nnx.merge(graphdef, join(jax.tree.map(jnp.zeros_like, params), frozen), model_state)
    reference = jax.lax.stop_gradient(answer_logprobs(adapters_off, batch))
    loss, margin, chosen, rejected = dpo_loss(policy, reference, beta)
    total = jnp.sum(loss)
    sums = {"ce_sum": total, "z_sum": jnp.zeros(()), "tokens": jnp.asarray(loss.shape[0], jnp.float32),
            "metric/reward_margin": jnp.sum(margin),
            "metric/reward_accuracy": jnp.sum((margin > 0).astype(jnp.float32)),
            "metric/chosen_reward": jnp.sum(chosen), "metric/rejected_reward": jnp.sum(rejected)}
    return total, (sums, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param))))

  return objective
