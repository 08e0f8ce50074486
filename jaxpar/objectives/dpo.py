"""Direct Preference Optimization (DPO, Rafailov et al. 2023), over adapters or the whole model.

For a prompt x with a chosen answer y_w and a rejected one y_l, and log-probabilities summed
over each answer's tokens under the policy (pi) and a frozen reference (ref):

  margin = beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x)))
  loss   = -log sigmoid(margin)

The reference runs in the same step under stop_gradient. Under model.lora it is the base
model with the adapters off (all adapter weights zero, so no second copy of the base is
held). Without adapters it is a frozen copy of the weights training started from
(objective.reference, else the seeded init), kept beside the policy (TrainState.frozen) and,
like a LoRA base, read again from its source on resume rather than saved. Computing it in the
step costs one more forward pass per step (and, without adapters, a second copy of the
weights, sharded as they are); precomputing every pair's reference log-probabilities once would
instead need a pass over the data before training and per-example values that the data
order, resumption and every mesh must carry along. Metrics per pair: `loss`,
`reward_margin` (the margin above), `reward_accuracy` (the share of pairs with margin > 0),
`chosen_reward` and `rejected_reward` (beta * the policy-minus-reference log-ratio of each).

beta -> 0: margin -> 0, so the loss -> ln 2 at every step and its gradient (which is
-beta * sigmoid(-margin) * d/dθ[log-ratio difference]) shrinks in proportion to beta: a
small beta lets the policy drift far from the reference before the loss saturates, a large
one keeps it close.

A batch holds data.global_batch_size pairs as twice as many rows: every chosen answer
first, then the rejected ones in the same order (jaxpar/data/preference_batches.py).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import Field

from jaxpar.data.preference_batches import PreferenceBatches
from jaxpar.errors import ConfigError
from jaxpar.objectives.base import (BASE, Objective, Options, model_state_of, policy_weights,
                                    register_objective)
from jaxpar.objectives.scoring import sequence_logprobs
from jaxpar.trees import join

REFERENCE = "reference"  # TrainState.frozen's key for the reference network (without adapters)


def answer_logprobs(model, batch, chunk_len: int = 0):
  """[rows] log-probability of each row's masked target tokens (the answer), summed."""
  logp = sequence_logprobs(model, batch, chunk_len)[0]
  return jnp.sum(logp * batch["loss_mask"].astype(jnp.float32), axis=-1)


def dpo_loss(policy, reference, beta: float):
  """policy, reference: [2 * pairs] answer log-probs (chosen rows, then rejected) ->
  (loss [pairs], margin [pairs], chosen reward [pairs], rejected reward [pairs])."""
  pairs = policy.shape[0] // 2
  ratio = beta * (policy - reference)
  chosen, rejected = ratio[:pairs], ratio[pairs:]
  margin = chosen - rejected
  return -jax.nn.log_sigmoid(margin), margin, chosen, rejected


def make_dpo_objective(graphdef, beta: float, chunk_len: int = 0):
  """(trained weights, model_state, batch, frozen) -> (summed loss, (sums, model_state)), as
  the objective protocol says: the step divides the sums by "tokens", here the pairs.
  frozen: the base under adapters, or the reference network without them. chunk_len > 0:
  the logits chunk_len positions at a time (scoring.sequence_logprobs)."""
  def objective(params, model_state, batch, frozen=None):
    frozen = frozen or {}
    model = nnx.merge(graphdef, policy_weights(params, frozen), model_state)
    policy = answer_logprobs(model, batch, chunk_len)
    if REFERENCE in frozen:
      reference_weights = frozen[REFERENCE]
    else:  # adapters: the base with them off
      reference_weights = join(jax.tree.map(jnp.zeros_like, params), frozen[BASE])
    reference = jax.lax.stop_gradient(
        answer_logprobs(nnx.merge(graphdef, reference_weights, model_state), batch, chunk_len))
    loss, margin, chosen, rejected = dpo_loss(policy, reference, beta)
    total = jnp.sum(loss)
    sums = {"ce_sum": total, "z_sum": jnp.zeros(()), "tokens": jnp.asarray(loss.shape[0], jnp.float32),
            "metric/reward_margin": jnp.sum(margin),
            "metric/reward_accuracy": jnp.sum((margin > 0).astype(jnp.float32)),
            "metric/chosen_reward": jnp.sum(chosen), "metric/rejected_reward": jnp.sum(rejected)}
    return total, (sums, model_state_of(model))

  return objective


class DPOOptions(Options):
  beta: float = Field(0.1, gt=0)
  # Without adapters: the checkpoint whose weights are the reference and where the policy
  # starts (None: the model's init from train.seed). With them the reference is the base.
  reference: str | None = None


@register_objective
class DPO(Objective):
  name = "dpo"
  formats = ("preference",)
  Options = DPOOptions

  def check(self):
    super().check()
    if self.adapters and self.options.reference is not None:
      raise ConfigError(f"objective.reference={self.options.reference} with model.lora: the reference is the "
                        "base with the adapters off; drop objective.reference, or model.lora for full-model DPO")

  def batches(self, tokenizer, sharding):
    return PreferenceBatches(self.config.data, tokenizer, sharding)

  def loss(self):
    return make_dpo_objective(self.runtime.graphdef, self.options.beta, self.config.train.logits_chunk_len)

  def kept_networks(self):
    return {} if self.adapters else {REFERENCE: self.options.reference}

  @property
  def policy_start(self):
    return None if self.adapters else REFERENCE
