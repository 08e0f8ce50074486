"""The train state: what a step reads and writes, and what a checkpoint holds."""

from typing import Any

from flax import struct


@struct.dataclass
class TrainState:
  """step: int32 scalar; params: what the optimizer updates (nnx.Param leaves);
  opt_state: the optimizer's state; model_state: every other model variable (router
  biases, statistics), changed only by the model's own forward pass, never decayed."""
  step: Any
  params: Any
  opt_state: Any
  model_state: Any

  def items(self) -> dict:
    """As a dict of the four fields (what the checkpointer saves and restores)."""
    return {"step": self.step, "params": self.params, "opt_state": self.opt_state,
            "model_state": self.model_state}
