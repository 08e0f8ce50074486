"""The least collective traffic a layout needs per step: what `jaxpar compile` measures the
compiled program against.

Per device per step, in bytes on the wire (ring algorithms: a gather or reduce-scatter of
S bytes over n devices sends S (n-1)/n, an all-reduce twice that), for m microbatches:

  fsdp-split weights  all-gathered in the compute dtype: layer weights twice per microbatch
                      (forward, and the remat/backward pass; once with remat=none, where the
                      backward may keep the forward's gathered copy), the embedding table and the
                      output projection once per step (the fused loss uses its gathered copy
                      for both passes, and every microbatch can share it); gradients
                      reduce-scattered once per microbatch in the compute dtype. The
                      embedding's gradient needs at most that: exchanging the gradient rows
                      of this device's tokens (an all-to-all) can be less.
  replicated weights  (norm scales) gradients all-reduced over the batch-split devices.
  data replicas       the weight-gradient shard all-reduced across the data axis, once.
  tensor split        per layer and microbatch, the attention and MLP outputs all-reduced in
                      the forward pass and their input gradients in the backward (x 1.5
                      with full remat: the forward runs twice); the embedding's partial rows
                      and the loss's per-token log-sum-exp pieces likewise.

Shapes come from the abstract model and the config's rules (mesh/sharding.py), so every
parameter is counted in the layout it really has.

Across slices (`minimum_dcn_bytes`) only what must cross the data-center network counts,
with hierarchical collectives (reduce inside the slice first, gather across slices first),
for the axis that spans the slices (mesh.dcn_axis over mesh.num_slices = k):

  data   the weight-gradient shard each device holds after the in-slice reduction,
         all-reduced across the k slices once per step.
  fsdp   each FSDP gather and gradient reduce-scatter moves (k - 1) x the device's shard.
  stage  the hand-offs: every pipeline iteration (T = M x R + S - 1, the bubble's too: in one
         SPMD program every stage sends every iteration) sends one microbatch's activations
         on, and its gradient back in the backward pass; the last stage's outputs reach every
         stage by an all-reduce over `stage` (and its transpose); the weights outside the
         stages, split over `stage` as FSDP, are gathered and their gradients reduce-scattered
         across the slices.
"""

import math

from flax import nnx

from jaxpar.mesh import logical_to_spec
from jaxpar.runtime import abstract_model

_BYTES = {"float32": 4, "bfloat16": 2}


def _ring(size: float, n: int) -> float:
  return size * (n - 1) / n if n > 1 else 0.0


def minimum_wire_bytes(config, mesh, rules) -> dict[str, float]:
  """{part: bytes on the wire per device per step} and "total", for `config` on `mesh`."""
  m, d = config.model, config.data
  micro = config.train.microbatches
  compute, param_bytes = _BYTES[m.compute_dtype], _BYTES[m.param_dtype]
  fsdp, data, tensor = (mesh.shape.get(a, 1) for a in ("fsdp", "data", "tensor"))
  batch_split = math.prod(mesh.shape[a] for a in dict(rules)["batch"] if a in mesh.shape)
  tokens = d.global_batch_size // micro // batch_split * d.seq_len  # per device per microbatch
  parts = {"weight all-gather": 0.0, "gradient reduce-scatter": 0.0, "gradient all-reduce": 0.0,
           "data all-reduce": 0.0, "tensor activations": 0.0}
  for path, names, axes, local in _placed_parameters(config, mesh, rules):
    if "fsdp" in axes and fsdp > 1:
      gathered = local * fsdp * compute
      table = path[-1] == "embed"
      layer_gathers = 1 if m.remat == "none" else 2
      gathers = layer_gathers * micro if names[0] == "layers" else 2 if table and m.tie_embeddings else 1
      parts["weight all-gather"] += gathers * _ring(gathered, fsdp)
      scatter = _ring(gathered, fsdp)
      if table and not m.tie_embeddings:  # or the rows of this device's tokens, if less
        scatter = min(scatter, _ring(tokens * m.embed_dim / tensor * compute, fsdp))
      parts["gradient reduce-scatter"] += micro * scatter
    elif batch_split > 1:
      parts["gradient all-reduce"] += micro * 2 * _ring(local * param_bytes, batch_split // data)
    parts["data all-reduce"] += 2 * _ring(local * param_bytes, data)
  if tensor > 1:
    passes = 3 if m.remat == "full" else 2  # forward (twice with full remat) + backward
    per_layer = 2 * passes * 2 * _ring(tokens * m.embed_dim * compute, tensor)
    parts["tensor activations"] = micro * (m.num_layers * per_layer
                                           + 2 * 2 * _ring(tokens * m.embed_dim * compute, tensor)
                                           + 2 * 2 * _ring(tokens * 4.0, tensor))
  parts["total"] = sum(parts.values())
  return parts


def minimum_dcn_bytes(config, mesh, rules) -> dict[str, float]:
  """{part: bytes per device per step across slices} and "total", for `config` on `mesh` with
  mesh.dcn_axis spanning mesh.num_slices slices (see the module docstring); {} on one slice."""
  slices, axis = config.mesh.num_slices, config.mesh.dcn_axis
  if slices < 2:
    return {}
  m, d, micro = config.model, config.data, config.train.microbatches
  compute, param_bytes = _BYTES[m.compute_dtype], _BYTES[m.param_dtype]
  parts = {}
  if axis == "stage":
    plan = config.plan()
    stages, pieces = plan.stages, plan.microbatches
    iterations = pieces * plan.repeats + stages - 1
    batch_split = math.prod(mesh.shape[a] for a in dict(rules)["batch"] if a in mesh.shape)
    positions = d.seq_len // config.plan(mesh).size("context")
    step_rows = d.global_batch_size // micro // batch_split  # per device per accumulation step
    activations = step_rows // pieces * positions * m.embed_dim * compute
    parts["stage hand-offs"] = micro * 2 * iterations * activations
    parts["stage outputs"] = micro * 2 * 2 * _ring(step_rows * positions * m.embed_dim * compute, stages)
  weights = 0.0
  for path, names, axes, local in _placed_parameters(config, mesh, rules):
    if axis == "data":
      weights += 2 * _ring(local * param_bytes / (mesh.shape["data"] // slices), slices)
    elif axis in axes and not (axis == "stage" and path[0] == "layers"):
      table = path[-1] == "embed"
      layer_gathers = 1 if m.remat == "none" else 2
      gathers = layer_gathers * micro if names[0] == "layers" else 2 if table and m.tie_embeddings else 1
      weights += (gathers + micro) * local * compute * (slices - 1)
  parts["gradient all-reduce" if axis == "data" else
        "weights outside the stages" if axis == "stage" else "fsdp gathers and reduce-scatters"] = weights
  parts["total"] = sum(parts.values())
  return parts


def _placed_parameters(config, mesh, rules):
  """(path, logical names, mesh axes it is split over, elements per device) per parameter."""
  for path, variable in _parameters(config.model):
    names = tuple(variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape))
    spec = logical_to_spec(names, variable.shape, mesh, rules)
    axes = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
    yield path, names, axes, math.prod(variable.shape) / math.prod(mesh.shape[a] for a in axes)


def _parameters(model_cfg):
  """(path, abstract nnx.Param) of every parameter."""
  _, params, _ = abstract_model(model_cfg)
  return [(tuple(str(k) for k in path), v) for path, v in nnx.to_flat_state(params)]
