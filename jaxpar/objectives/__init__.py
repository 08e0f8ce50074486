"""Training objectives as plug-ins (base.py says what one brings): `lm` (next-token prediction
on text), `sft` (on chat rows, the assistant's tokens), `dpo` (preference pairs). Another is
a class decorated with `register_objective`, imported before the config names it."""

from jaxpar.objectives import dpo, lm  # noqa: F401  (registers the built-in objectives)
from jaxpar.objectives.base import (BASE, OBJECTIVES, Objective, Options, get_objective, migrate_objective_keys,
                                    policy_weights, register_objective)

__all__ = ["BASE", "OBJECTIVES", "Objective", "Options", "get_objective", "migrate_objective_keys", "policy_weights",
           "register_objective"]
