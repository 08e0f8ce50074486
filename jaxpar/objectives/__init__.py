"""Training objectives as plug-ins (base.py says what one brings): `lm` (next-token prediction
on text), `sft` (on chat rows, the assistant's tokens), `dpo` (preference pairs), `grpo`
(reinforcement learning on prompts, jaxpar/rl/), `medusa` (draft heads over a frozen model).
Another is a class decorated with `register_objective` in a new module here, or in an installed
package's `jaxpar.objectives` entry point (jaxpar/plugins.py): no edit elsewhere."""

from jaxpar import plugins
from jaxpar.objectives import base
from jaxpar.objectives.base import (BASE, OBJECTIVES, Objective, Options, get_objective, migrate_objective_keys,
                                    policy_weights, register_objective, registered)

ENTRY_POINTS = "jaxpar.objectives"
base._plugins["load"] = lambda: plugins.load(__name__, __path__, ENTRY_POINTS)

__all__ = ["BASE", "OBJECTIVES", "Objective", "Options", "get_objective", "migrate_objective_keys", "policy_weights",
           "register_objective", "registered"]
