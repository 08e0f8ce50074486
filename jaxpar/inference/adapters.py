"""Several LoRA adapters served over one base, in one batch (`jaxpar serve --adapter NAME=PATH`).

The engine's model is the base with each adapted projection carrying a stack of adapters
(model.lora.stacked = n + 1): stack slot 0 is all zeros (the base alone), slot i is the i-th
adapter. Every batch row carries its request's slot, and each adapted projection gathers
that row's A and B (models/lora.py), so one compiled prefill or decode step serves any mix of
adapters, and a new mix compiles nothing. We gather rather than run a segmented (grouped)
matmul: at serving batch sizes the gathered [batch, in, rank] and [batch, rank, out] are
small beside the base weights every row reads anyway, and rows need no sorting by adapter.

Adapters may differ in rank, alpha and targets: the stack has the largest rank and the union
of the targets; each adapter is zero-padded to that rank (zeros add nothing), its own
alpha / rank is folded into its B, and it is zero on projections it does not adapt.
"""

import jax
import numpy as np

from jaxpar.weights import lookup
from jaxpar.errors import CheckpointError
from jaxpar.weights import same_network, split_weights
from jaxpar.weights import join
from jaxpar.models.config import LoRAConfig
from jaxpar.runtime import Runtime
from jaxpar.weights import SavedRun


def _trained(run, name: str, path) -> tuple[dict, LoRAConfig]:
  """(adapters, their model.lora) of adapter checkpoint `path`, on the base run's mesh."""
  with SavedRun(path) as source:
    lora = source.config.model.lora
    if lora is None:
      raise CheckpointError(f"--adapter {name}={path} is not an adapter checkpoint (its config has no "
                            "model.lora): serve it as a model of its own")
    if lora.experts:
      raise CheckpointError(f"--adapter {name}={path} adapts routed experts, which cannot differ per batch "
                            "row: merge it (`jaxpar lora merge`) and serve the merged model")
    if not same_network(run.config.model, source.config.model):
      raise CheckpointError(f"--adapter {name}={path} was trained over another model than {run.directory} "
                            f"(its base: {lora.base}): serve it over that base")
    own = Runtime(source.config.model, run.runtime.mesh_config, run.runtime.mesh.devices.flat,
                  parallel=run.config.parallel)
    return source.read_adapters(own), lora


def _stack(abstract, names, path, trained) -> np.ndarray:
  """One stacked adapter leaf [*layers, n + 1, ...] from each adapter's own (or zeros)."""
  stacked = np.zeros(abstract.shape, abstract.dtype)
  at = names.index(None)  # the stack axis: the first unnamed one, after the layer axes
  for slot, (adapters, lora) in enumerate(trained, 1):
    own = lookup(adapters, path)
    if own is None:
      continue  # this adapter leaves the projection alone
    own, lead = np.asarray(jax.device_get(own)), (slice(None),) * at + (slot,)
    if path[-1] == "a":  # [*layers, *in, rank]
      stacked[(*lead, ..., slice(0, lora.rank))] = own
    else:  # [*layers, rank, *out], with its scale: the stack's is 1
      stacked[(*lead, slice(0, lora.rank))] = own * lora.scale
  return stacked


def stacked_adapters(run, adapters: dict) -> tuple[Runtime, dict]:
  """(runtime whose model stacks the adapters, params: the base's weights and the stack) for a
  loaded base `run` (jaxpar.open_run) and adapter checkpoints by name, in slot order."""
  base = run.config.model
  if base.lora is not None:
    raise CheckpointError(f"{run.directory} holds adapters itself: serve its base ({base.lora.base}) with "
                          f"--adapter NAME={run.directory}, or merge it first (`jaxpar lora merge`)")
  trained = [_trained(run, name, path) for name, path in adapters.items()]
  rank = max(lora.rank for _, lora in trained)
  targets = tuple(dict.fromkeys(t for _, lora in trained for t in lora.targets))
  stack = LoRAConfig(rank=rank, alpha=rank, targets=targets, stacked=len(trained) + 1)
  runtime = Runtime(base.model_copy(update={"lora": stack}), run.runtime.mesh_config,
                    run.runtime.mesh.devices.flat, seed=run.config.train.seed, parallel=run.config.parallel)
  abstract, _ = split_weights(runtime, runtime.abstract_params)
  names, _ = split_weights(runtime, runtime.axis_names)
  shardings, _ = split_weights(runtime, runtime.param_shardings)

  def build(tree, path=()):
    return {k: build(v, path + (k,)) if isinstance(v, dict) else
            jax.device_put(_stack(v, lookup(names, (*path, k)), (*path, k), trained), lookup(shardings, (*path, k)))
            for k, v in tree.items()}
  return runtime, join(build(abstract), run.params)
