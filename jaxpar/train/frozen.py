"""What a train state keeps beside the policy (TrainState.frozen), never trained or saved: the
base weights under adapters (model.lora) and the whole networks the objective keeps (DPO's
reference). Each is read again from its source when a run starts or resumes."""

import jax

from jaxpar.objectives import BASE
from jaxpar.weights import load_base, read_network, split_weights


class FrozenWeights:
  """The frozen parts of one trainer's state: `runtime` (its adapters, if any) and `objective`
  (its kept networks and where the policy starts)."""

  def __init__(self, runtime, objective):
    self.runtime, self.objective = runtime, objective
    self.networks = objective.kept_networks()
    if BASE in self.networks:
      raise ValueError(f"objective {objective.name} keeps a network named {BASE!r}, the adapters' base")

  @property
  def any(self) -> bool:
    """Whether anything is kept (then a fresh state reads it from where it lives)."""
    return self.runtime.adapter_mask is not None or bool(self.networks)

  def trainable(self, tree: dict) -> dict:
    """The part of a params-shaped tree that trains (all of it, or the adapters)."""
    return split_weights(self.runtime, tree)[0]

  def split(self, params: dict) -> tuple[dict, dict]:
    """(what trains, TrainState.frozen) of a whole params-shaped tree (arrays, shapes or
    shardings): the kept networks are shaped and placed like the whole model."""
    trained, base = split_weights(self.runtime, params)
    frozen = {BASE: base} if self.runtime.adapter_mask is not None else {}
    return trained, {**frozen, **{name: params for name in self.networks}}

  def load(self) -> dict:
    """TrainState.frozen read from its sources: the base model.lora.base names, each kept
    network's checkpoint (or the seeded init)."""
    frozen = {BASE: load_base(self.runtime)} if self.runtime.adapter_mask is not None else {}
    for name, path in self.networks.items():
      frozen[name] = read_network(self.runtime, path, f"objective.{name}")
    return frozen

  def starting_policy(self, frozen: dict) -> dict | None:
    """The weights a fresh policy starts as, where the objective says (its own buffers: the
    step donates them), else None (the seeded init)."""
    start = self.objective.policy_start
    return None if start is None else jax.tree.map(lambda x: x.copy(), frozen[start])
