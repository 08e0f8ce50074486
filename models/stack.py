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
written back into the stack after the scan. Layers whose parameters differ in structure (a
hybrid model's attention and linear-attention layers) live in stacks of their own and run
interleaved through the same unit scan (`run_stacks`).
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
  carry, outputs = run_stacks({"": layers}, [("", fn) for fn in layer_fns], carry, {"": inputs},
                              scan=scan, unroll=unroll)
  return carry, outputs[""]


def run_stacks(stacks: dict, unit: list, carry, inputs: dict, *, scan: bool, unroll: int = 1):
  """Layers kept in several stacks, one per parameter structure (a hybrid's attention and
  linear-attention layers), run interleaved: layer i runs `unit[i % len(unit)]`, a (stack
  name, per-layer function) pair, on the next unused layer of that stack -> (final carry,
  {stack name: outputs stacked over its layers}). inputs: {stack name: per-layer pytree or None}.
  """
  period = len(unit)
  if not scan:
    taken, per_layer = dict.fromkeys(stacks, 0), {name: [] for name in stacks}
    for i in range(sum(len(layers) for layers in stacks.values())):
      name, fn = unit[i % period]
      j, taken[name] = taken[name], taken[name] + 1
      carry, outputs = fn(stacks[name][j], carry, jax.tree.map(lambda x: x[j], inputs[name]))
      per_layer[name].append(outputs)
    return carry, {name: _stack(outputs) for name, outputs in per_layer.items()}
  split = {name: nnx.split(layers, nnx.Param, ...) for name, layers in stacks.items()}
  stacked = {name: (params, others, inputs[name]) for name, (_, params, others) in split.items()}
  count = sum(jax.tree.leaves(params)[0].shape[0] for _, params, _ in split.values())
  units, rest = divmod(count, period)

  def one_layer(name, fn, carry, layer_xs):
    layer_params, layer_others, layer_inputs = layer_xs
    layer = nnx.merge(split[name][0], layer_params, layer_others)
    carry, outputs = fn(layer, carry, layer_inputs)
    return carry, (outputs, nnx.state(layer, nnx.Not(nnx.Param)))

  if period == 1:  # one layer per step, over the stacked arrays as they are
    name, fn = unit[0]
    carry, (outputs, updated) = jax.lax.scan(functools.partial(one_layer, name, fn), carry, stacked[name],
                                             unroll=unroll)
    nnx.update(stacks[name], updated)
    return carry, {name: outputs}

  def body(positions):
    """The body over one unit: xs[name]'s leaves are [that stack's layers in the unit, ...]."""
    def run(carry, xs):
      taken, per_layer = dict.fromkeys(xs, 0), {name: [] for name in xs}
      for name, fn in positions:
        j, taken[name] = taken[name], taken[name] + 1
        carry, results = one_layer(name, fn, carry, jax.tree.map(lambda x: x[j], xs[name]))
        per_layer[name].append(results)
      return carry, {name: _stack(results) for name, results in per_layer.items()}
    return run

  per_unit = {name: [n for n, _ in unit].count(name) for name in stacks}
  in_tail = {name: [n for n, _ in unit[:rest]].count(name) for name in stacks}
  # [units * n, ...] -> [units, n, ...] is free; a [count, 1, ...] view would not be (XLA
  # copies every weight to add the unit axis), hence the plain scan above.
  results = {name: [] for name in stacks}
  if units:
    head = {name: jax.tree.map(lambda x, n=n: x[:units * n].reshape(units, n, *x.shape[1:]), stacked[name])
            for name, n in per_unit.items() if n}
    carry, out = jax.lax.scan(body(unit), carry, head, unroll=unroll)
    for name, tree in out.items():
      results[name].append(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree))
  if rest:
    tail = {name: jax.tree.map(lambda x, n=per_unit[name]: x[units * n:], stacked[name])
            for name, n in in_tail.items() if n}
    carry, out = body(unit[:rest])(carry, tail)
    for name, tree in out.items():
      results[name].append(tree)
  outputs = {}
  for name, parts in results.items():
    outputs[name], updated = jax.tree.map(lambda *p: jnp.concatenate(p), *parts)
    nnx.update(stacks[name], updated)
  return carry, outputs


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)
