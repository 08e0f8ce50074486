"""The train state: what a step reads and writes, and what a checkpoint holds."""

from typing import Any

from flax import struct

from jaxpar.objectives import policy_weights


@struct.dataclass
class TrainState:
  """step: int32 scalar; params: what the optimizer updates (nnx.Param leaves);
  opt_state: the optimizer's state; model_state: every other model variable (router
  biases, statistics), changed only by the model's own forward pass, never decayed;
  frozen: the weights that do not train, by name (jaxpar/train/frozen.py): the base model
  under adapters (model.lora), the networks the objective keeps (DPO's reference); read by
  every step but neither updated nor saved in checkpoints."""
  step: Any
  params: Any
  opt_state: Any
  model_state: Any
  frozen: Any = struct.field(default_factory=dict)

  def weights(self) -> dict:
    """Every parameter of the policy (the trained and the base under them): what the model is
    merged with. A kept network (a reference) is another model."""
    return policy_weights(self.params, self.frozen)

  def items(self) -> dict:
    """As a dict of the four fields (what the checkpointer saves and restores)."""
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state,
            "model_state": self.model_state}
