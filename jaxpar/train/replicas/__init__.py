"""Low-communication data parallelism (train.sync): replicas on the `data` axis that take
local steps and sync their parameters now and then (training.py)."""

from jaxpar.train.replicas.training import ReplicaTraining

__all__ = ["ReplicaTraining"]
