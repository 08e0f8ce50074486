"""Next-token prediction: `lm` on text documents, `sft` on chat rows (loss on the assistant's
tokens only, jaxpar/data/chat_batches.py). The loss is cross-entropy + z-loss + the model's
auxiliary losses; evaluation reports the same sums without gradients."""

import jax
from flax import nnx

from jaxpar.data import TrainBatches
from jaxpar.data.chat_batches import ChatBatches
from jaxpar.mesh import num_shards
from jaxpar.objectives.base import Objective, model_state_of, policy_weights, register_objective
from jaxpar.pallas_kernels import zigzag
from jaxpar.train.loss import causal_lm_loss, fused_lm_loss


def lm_loss(graphdef, *, z_loss: float, logits_chunk_len: int = 0, load_balance: bool = True,
            kv_quantization=None):
  """(params, model_state, batch, frozen=None) -> (objective, (sums, new model_state)): what
  training differentiates and evaluation reports. `frozen`: TrainState.frozen (the base under
  adapters is part of the model; nothing else is read).

  sums: {"ce_sum", "z_sum", "tokens"} plus, for each auxiliary loss or metric the model
  returns, its value x tokens under "loss/NAME" or "metric/NAME".
  logits_chunk_len > 0: the fused chunked loss (never holds all logits); 0: plain logits.
  load_balance: zig-zag order over the devices that split the length (if any): every array
  of the batch moves together, once, before the model, and the sums do not depend on the order.
  kv_quantization (a kv_quant.KVQuantization): attend as through that quantized KV cache
  (evaluating a cache's quality).
  """
  def objective(params, model_state, batch, frozen=None):
    model = nnx.merge(graphdef, policy_weights(params, frozen), model_state)
    shards = num_shards("length")
    balanced = load_balance and shards > 1
    if balanced:
      batch = jax.tree.map(lambda x: zigzag(x, shards), batch)
    inputs = (batch["inputs"], batch["positions"], batch["segment_ids"])
    if logits_chunk_len:
      hidden, aux = model.hidden_states(*inputs, kv_quantization, zigzag=balanced)
      total, sums = fused_lm_loss(hidden, model.output_projection(), batch["targets"],
                                  batch["loss_mask"], z_loss, logits_chunk_len, model.cfg.final_logit_soft_cap)
    else:
      logits, aux = model(*inputs, kv_quantization, zigzag=balanced)
      total, sums = causal_lm_loss(logits, batch["targets"], batch["loss_mask"], z_loss)
    tokens = sums["tokens"]
    for name, value in aux["losses"].items():
      total = total + tokens * value
      sums[f"loss/{name}"] = tokens * value
    for name, value in aux["metrics"].items():
      sums[f"metric/{name}"] = tokens * value
    return total, (sums, model_state_of(model))

  return objective


@register_objective
class LanguageModel(Objective):
  name = "lm"
  formats = ("text",)

  def batches(self, tokenizer, sharding):
    return TrainBatches(self.config.data, tokenizer, sharding)

  def loss(self):
    train = self.config.train
    return lm_loss(self.runtime.graphdef, z_loss=train.z_loss, logits_chunk_len=train.logits_chunk_len,
                   load_balance=self.runtime.plan.load_balance)


@register_objective
class ChatFineTuning(LanguageModel):
  """Supervised fine-tuning on conversations: the language-model loss on the assistant's tokens."""
  name = "sft"
  formats = ("chat",)

  def batches(self, tokenizer, sharding):
    return ChatBatches(self.config.data, tokenizer, sharding)
