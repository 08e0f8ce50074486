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
  for path, variable in _parameters(m):
    names = tuple(variable.get_metadata().get("out_sharding") or (None,) * len(variable.shape))
    spec = logical_to_spec(names, variable.shape, mesh, rules)
    axes = [a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
    local = math.prod(variable.shape) / math.prod(mesh.shape[a] for a in axes)
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


def _parameters(model_cfg):
  """(path, abstract nnx.Param) of every parameter."""
  _, params, _ = abstract_model(model_cfg)
  return [(tuple(str(k) for k in path), v) for path, v in nnx.to_flat_state(params)]
