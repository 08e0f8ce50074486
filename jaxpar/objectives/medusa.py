"""Medusa-1 draft heads (Cai et al. 2024), trained over a frozen model: `train.objective: medusa`.

Head i (models/medusa.py) reads the model's final-normed hidden state at position t and is
trained to guess token t + 2 + i with cross-entropy, the heads' losses summed with weight
decay ** i (Medusa's 0.8: the further ahead, the less a head can know). Only the heads train
(`model.medusa`: they are the adapter_mask's leaves, the base is TrainState.frozen's, read
again from model.medusa.base); the base runs forward only. Targets come from the batch's own
tokens, so any data source the readers take trains them (text, or chat rows where the loss
mask keeps the assistant's tokens). Each head's mean loss is reported as `head{i}_loss`.

The first step also writes the base's fingerprint into the heads' model state, saved with
them: serving them over another base is refused (jaxpar/inference/medusa.py).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import Field

from jaxpar.data import TrainBatches
from jaxpar.data.chat_batches import ChatBatches
from jaxpar.errors import ConfigError
from jaxpar.models.medusa import fingerprint
from jaxpar.objectives.base import BASE, Objective, Options, model_state_of, policy_weights, register_objective
from jaxpar.train.loss import causal_lm_loss, fused_lm_loss


def ahead(batch, shift: int):
  """(targets, loss mask) `shift` positions further on: row position t gets the target of
  t + shift, masked where that runs past the row or into another packed document."""
  length = batch["targets"].shape[1]
  later = lambda x: jnp.roll(x, -shift, axis=1)  # noqa: E731
  inside = (jnp.arange(length) < length - shift)[None]
  same_document = later(batch["segment_ids"]) == batch["segment_ids"]
  return later(batch["targets"]), later(batch["loss_mask"]).astype(bool) & inside & same_document


def medusa_loss(graphdef, heads: int, decay: float, logits_chunk_len: int = 0):
  """(trained heads, model_state, batch, frozen) -> (summed loss, (sums, model_state)), as the
  objective protocol says; "tokens" counts head 0's targets and every head's sum is scaled to
  that count, so each `head{i}_loss` is that head's own mean."""
  def objective(params, model_state, batch, frozen=None):
    model = nnx.merge(graphdef, policy_weights(params, frozen), model_state)
    stamp = model.medusa.base_fingerprint
    stamp[...] = jax.lax.cond(jnp.any(stamp[...] != 0), lambda: stamp[...], lambda: fingerprint(frozen[BASE]))
    hidden, _ = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
    hidden = jax.lax.stop_gradient(hidden)  # the base is frozen: nothing flows back into it
    per_head = model.medusa.hidden(hidden)  # [B, L, heads, embed]
    projection = jax.lax.stop_gradient(model.output_projection())
    total, sums, tokens = 0.0, {}, None
    for head in range(heads):
      targets, mask = ahead(batch, head + 1)
      if logits_chunk_len:
        ce, head_sums = fused_lm_loss(per_head[:, :, head], model.medusa.projection(head, projection), targets,
                                      mask, 0.0, logits_chunk_len, model.cfg.final_logit_soft_cap)
      else:
        logits = per_head[:, :, head] @ model.medusa.projection(head, projection)
        cap = model.cfg.final_logit_soft_cap
        ce, head_sums = causal_lm_loss(logits if cap is None else cap * jnp.tanh(logits / cap), targets, mask)
      tokens = head_sums["tokens"] if tokens is None else tokens
      ce = ce * tokens / jnp.maximum(head_sums["tokens"], 1.0)  # this head's mean, times head 0's count
      sums[f"metric/head{head}_loss"] = ce
      total = total + decay ** head * ce
    sums.update({"ce_sum": total, "z_sum": jnp.zeros(()), "tokens": tokens})
    return total, (sums, model_state_of(model))

  return objective


def head_accuracy(model, batch) -> list[float]:
  """Each head's top-1 accuracy on a batch (held-out text): the share of masked positions
  where its best guess is the token it is trained to guess."""
  hidden, _ = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
  guesses = jnp.argmax(model.medusa.logits(hidden, model.output_projection()), -1)  # [B, L, heads]
  accuracy = []
  for head in range(model.medusa.count):
    targets, mask = ahead(batch, head + 1)
    hits = (guesses[..., head] == targets) & mask
    accuracy.append(float(jnp.sum(hits) / jnp.maximum(jnp.sum(mask), 1)))
  return accuracy


def rank_accuracy(model, batch, ranks: int):
  """[heads, ranks]: the share of masked positions where head h's rank-r guess is the token it
  is trained to guess (held-out text): what `draft_tree.choose_tree` grows a tree from."""
  hidden, _ = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"])
  top = jax.lax.top_k(model.medusa.logits(hidden, model.output_projection()), ranks)[1]  # [B, L, heads, ranks]
  rows = []
  for head in range(model.medusa.count):
    targets, mask = ahead(batch, head + 1)
    hits = (top[:, :, head] == targets[..., None]) & mask[..., None]
    rows.append(jnp.sum(hits, axis=(0, 1)) / jnp.maximum(jnp.sum(mask), 1))
  return jnp.stack(rows)


class MedusaOptions(Options):
  decay: float = Field(0.8, gt=0, le=1)  # head i's loss weight is decay ** i


@register_objective
class Medusa(Objective):
  name = "medusa"
  formats = ("text", "chat")
  Options = MedusaOptions

  def check(self):
    super().check()
    if self.config.model.medusa is None:
      raise ConfigError("train.objective=medusa trains draft heads: add `medusa: {heads: 4, base: BASE_RUN}` "
                        "to the model section (base: the checkpoint of the model they draft for)")

  def batches(self, tokenizer, sharding):
    reader = ChatBatches if self.config.data.format == "chat" else TrainBatches
    return reader(self.config.data, tokenizer, sharding)

  def loss(self):
    model = self.config.model
    return medusa_loss(self.runtime.graphdef, model.medusa.heads, self.options.decay,
                       self.config.train.logits_chunk_len)
