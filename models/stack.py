"""The layer stack: build N identical layers and run them in order, scanned or unrolled.

Each layer runs through one per-layer function, `(layer, carry, inputs) -> (carry, outputs)`:
`carry` flows from layer to layer (the activations), `inputs` holds this layer's slice of
anything stacked per layer (its KV cache), and `outputs` is stacked over layers (its
auxiliary losses and metrics, its updated cache). A pipeline schedule can wrap the same
function. Non-parameter variables a layer changes (router biases, statistics) are written
back into the stack after the scan.
"""

import jax
from flax import nnx

REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "save_dots": jax.checkpoint_policies.checkpoint_dots,
  "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_policy(remat):
  """A preset's policy, or for {name: save | offload | recompute} (the names the layers tag
  with `checkpoint_name`): keep the saved ones in device memory, move the offloaded ones to
  pinned host memory between the forward and backward pass, recompute everything else."""
  if isinstance(remat, str):
    return REMAT_POLICIES[remat]
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[n for n, a in remat.items() if a == "save"],
      names_which_can_be_offloaded=[n for n, a in remat.items() if a == "offload"],
      offload_src="device", offload_dst="pinned_host")


def create_layers(make_layer, count: int, rngs: nnx.Rngs, *, scan: bool):
  """`count` layers from make_layer(rngs): one module whose arrays have a leading `layers`
  axis when `scan` (compile time stays flat in depth), else an nnx.List."""
  if not scan:
    return nnx.List([make_layer(rngs) for _ in range(count)])

  @nnx.split_rngs(splits=count)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def stacked(rngs):
    return make_layer(rngs)
  return stacked(rngs)


def with_remat(layer_fn, remat):
  """The per-layer function rematerialised under a preset or per-name policy (`none`: as is)."""
  if remat == "none":
    return layer_fn
  return nnx.remat(layer_fn, policy=remat_policy(remat))


def run_layers(layers, layer_fn, carry, inputs=None, *, scan: bool, unroll: int = 1):
  """Run layer_fn over `layers` in order -> (final carry, outputs stacked over layers).

  inputs: a pytree whose leaves have a leading layer axis, or None.
  """
  if scan:
    graphdef, params, others = nnx.split(layers, nnx.Param, ...)

    def body(carry, xs):
      layer_params, layer_others, layer_inputs = xs
      layer = nnx.merge(graphdef, layer_params, layer_others)
      carry, outputs = layer_fn(layer, carry, layer_inputs)
      return carry, (outputs, nnx.state(layer, nnx.Not(nnx.Param)))

    carry, (outputs, updated) = jax.lax.scan(body, carry, (params, others, inputs), unroll=unroll)
    nnx.update(layers, updated)
    return carry, outputs
  per_layer = []
  for i, layer in enumerate(layers):
    carry, outputs = layer_fn(layer, carry, jax.tree.map(lambda x: x[i], inputs))
    per_layer.append(outputs)
  return carry, jax.tree.map(lambda *xs: jax.numpy.stack(xs), *per_layer)
