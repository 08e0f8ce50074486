"""The layer stack: build N identical layers and run them in order, scanned or unrolled.

Each layer runs through a per-layer function, `(layer, carry, inputs) -> (carry, outputs)`:
`carry` flows from layer to layer (the activations, the KV cache), `inputs` holds this
layer's slice of anything stacked per layer (its index), and `outputs` is stacked over
layers (its auxiliary losses and metrics). Layers may differ in static options (a sliding
window on some): then there is one function per place in a repeating unit, layer i runs
`layer_fns[i % len(layer_fns)]`, and the scan runs over whole units, each unrolled inside,
so compile time stays flat in depth; the layers that do not fill a last unit run after it.
The parameters stay stacked per layer either way. A pipeline schedule can wrap the same
functions. Non-parameter variables a layer changes (router biases, statistics) are
written back into the stack after the scan.
"""

import functools

import jax
import jax.numpy as jnp
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


def run_layers(layers, layer_fns, carry, inputs=None, *, scan: bool, unroll: int = 1):
  """Run `layers` in order, layer i through layer_fns[i % len(layer_fns)] -> (final carry,
  outputs stacked over layers).

  inputs: a pytree whose leaves have a leading layer axis, or None.
  """
  period = len(layer_fns)
  if not scan:
    per_layer = []
    for i, layer in enumerate(layers):
      carry, outputs = layer_fns[i % period](layer, carry, jax.tree.map(lambda x: x[i], inputs))
      per_layer.append(outputs)
    return carry, _stack(per_layer)
  graphdef, params, others = nnx.split(layers, nnx.Param, ...)
  stacked = (params, others, inputs)
  count = jax.tree.leaves(params)[0].shape[0]
  units, rest = divmod(count, period)

  def one_layer(fn, carry, layer_xs):
    layer_params, layer_others, layer_inputs = layer_xs
    layer = nnx.merge(graphdef, layer_params, layer_others)
    carry, outputs = fn(layer, carry, layer_inputs)
    return carry, (outputs, nnx.state(layer, nnx.Not(nnx.Param)))

  if period == 1:  # one layer per step, over the stacked arrays as they are
    carry, (outputs, updated) = jax.lax.scan(functools.partial(one_layer, layer_fns[0]), carry, stacked,
                                             unroll=unroll)
    nnx.update(layers, updated)
    return carry, outputs

  def unit(fns):
    """The body over one unit: xs' leaves are [len(fns), ...]."""
    def body(carry, xs):
      per_layer = []
      for i, fn in enumerate(fns):
        carry, results = one_layer(fn, carry, jax.tree.map(lambda x: x[i], xs))
        per_layer.append(results)
      return carry, _stack(per_layer)
    return body

  # [units * period, ...] -> [units, period, ...] is free; a [count, 1, ...] view would not
  # be (XLA copies every weight to add the unit axis), hence the plain scan above.
  results = []
  if units:
    head = jax.tree.map(lambda x: x[:units * period].reshape(units, period, *x.shape[1:]), stacked)
    carry, per_unit = jax.lax.scan(unit(layer_fns), carry, head, unroll=unroll)
    results.append(jax.tree.map(lambda x: x.reshape(units * period, *x.shape[2:]), per_unit))
  if rest:
    carry, tail = unit(layer_fns[:rest])(carry, jax.tree.map(lambda x: x[units * period:], stacked))
    results.append(tail)
  outputs, updated = jax.tree.map(lambda *parts: jnp.concatenate(parts), *results)
  nnx.update(layers, updated)
  return carry, outputs


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
