"""The train state: what a step reads and writes, and what a checkpoint holds."""

from typing import Any

from flax import struct

from jaxpar.finetune.partition import join

# TrainState.frozen's key for full-model DPO's reference weights (jaxpar/finetune/dpo.py).
REFERENCE = "dpo_reference"


@struct.dataclass
class TrainState:
  """step: int32 scalar; params: what the optimizer updates (nnx.Param leaves);
  opt_state: the optimizer's state; model_state: every other model variable (router
  biases, statistics), changed only by the model's own forward pass, never decayed;
  frozen: the weights that do not train (with adapters, model.lora: the base model; for DPO
  without adapters: {REFERENCE: the reference model}; else empty), read by every step but
  neither updated nor saved in checkpoints."""
  step: Any
  params: Any
  opt_state: Any
  model_state: Any
  frozen: Any = struct.field(default_factory=dict)

  def weights(self) -> dict:
    """Every model parameter (the trained and the frozen): what the model is merged with."""
    base = {k: v for k, v in self.frozen.items() if k != REFERENCE}  # a reference is another model
    return join(self.params, base) if base else self.params

  def items(self) -> dict:
    """As a dict of the four fields (what the checkpointer saves and restores)."""
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state,
            "model_state": self.model_state}
