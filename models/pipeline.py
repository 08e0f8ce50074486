"""Pipeline parallelism: a stacked layer group run as `stages x repeats` groups of layers over
the devices of one mesh axis, microbatches streaming through, in one SPMD program.

The group's arrays stay [layers, ...] and are stored *stage-major*: stage s holds, one after
the other, the K layers it runs in each of its R repeats, so a contiguous split of the
stacked axis over the stage devices gives every stage exactly its layers and [layers] ->
[R, K] is a free reshape on each. Position s*R*K + r*K + k holds canonical layer
(r*S + s)*K + k (`stage_major_order`); with one repeat (GPipe) that is the identity.

Inside one `jax.shard_map` that is manual over the stage axis only (FSDP, tensor, context
and expert splits stay the compiler's, and nested kernels still shard_map over them), a
`lax.scan` runs T = M*R + S - 1 iterations. In each, every stage runs its K layers of its
current repeat on its current microbatch; the results move one stage on by
`lax.ppermute` (a collective-permute between neighbours; the last stage sends to the
first, which is how a circular schedule loops back); stage 0 takes the next microbatch, or
in a later repeat the one that came back. Stage s at iteration t holds item i = t - s
(microbatch i mod M, repeat i // M); outside 0 <= i < M*R it is in the bubble: its input is
replaced by zeros before use, so whatever a bubble buffer holds (tests fill them with NaN)
never reaches an output or a gradient, and its state updates and aux outputs are dropped.
Outputs come back to stage 0 and are summed over the stage axis (so every stage holds
them, for the head that follows).

Per stage, what the backward pass keeps is what the per-layer remat policy keeps of each
iteration's layers: at a fixed batch it does not grow with the microbatch count. Weight
gradients accumulate in the scan's transpose, never one copy per microbatch.
"""

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.mesh import current_execution_options
from jaxpar.mesh.shard_map import vmapped_mesh_axes
from jaxpar.models.stack import run_layers

_WEIGHTS = "pipeline_stage_weights"  # the weights of one repeat, cut from the stage's stack


def stage_major_order(count: int, stages: int, repeats: int) -> np.ndarray:
  """order[p] = the canonical index of the layer stored at position p."""
  per_stage = count // (stages * repeats)
  s, r, k = np.meshgrid(np.arange(stages), np.arange(repeats), np.arange(per_stage), indexing="ij")
  return ((r * stages + s) * per_stage + k).reshape(-1)


def reorder_layers(tree, group: str, source, target):
  """`tree` (params, model state, optimizer state: anything with the group's stacked arrays
  under a `group` key) with the group's layers moved from `source` order to `target` order
  (stage_major_order arrays; None: canonical). Works on arrays and inside jit."""
  if same_order(source, target):
    return tree
  count = len(source if source is not None else target)
  position = np.argsort(_or_identity(source, count))  # canonical layer -> its source position
  take = position[_or_identity(target, count)]

  def move(path, leaf):
    stacked = any(getattr(key, "key", None) == group for key in path)
    return jnp.take(leaf, take, axis=0) if stacked and leaf.ndim and leaf.shape[0] == count else leaf
  return jax.tree_util.tree_map_with_path(move, tree)


def same_order(source, target) -> bool:
  """Whether two layer orders (stage_major_order arrays, None: canonical) are the same."""
  if source is None and target is None:
    return True
  count = len(source if source is not None else target)
  return np.array_equal(_or_identity(source, count), _or_identity(target, count))


def _or_identity(order, count):
  return np.arange(count) if order is None else np.asarray(order)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """Idle share of each stage's iterations: (S - 1) / (M * R + S - 1)."""
  return (stages - 1) / (microbatches * repeats + stages - 1)


def run_group(layers, layer_fns, carry, inputs=None, *, scan: bool, unroll: int = 1,
              pipelined: bool = False):
  """`stack.run_layers`, or over the pipeline stages when the execution options have a
  pipeline and this is the group it runs (`pipelined`)."""
  options = current_execution_options().pipeline
  if options is None or not pipelined:
    return run_layers(layers, layer_fns, carry, inputs, scan=scan, unroll=unroll)
  return run_pipelined(layers, layer_fns, carry, inputs, options, unroll=unroll)


def _microbatches(x, count: int):
  """[B, ...] -> [count, B / count, ...], rows taken with stride `count` (each microbatch keeps
  the batch's sharding; the train step's accumulation splits the same way)."""
  return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def _merge_microbatches(x):
  return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def run_pipelined(layers, layer_fns, carry, inputs, options, *, unroll: int = 1):
  """Run the stacked `layers` (stage-major) over `options.stages` stages -> (final carry,
  per-layer outputs averaged over the microbatches, stacked in stored order).

  carry: a pytree whose every leaf has the batch as its leading axis (activations,
  positions, segment ids): each microbatch's carry streams through the stages whole.
  inputs: per layer (stored order), or None. Non-parameter variables of the layers (router
  biases) are updated microbatch after microbatch, as gradient accumulation would. The
  parallel plan (jaxpar/parallel.py) checked before anything was traced that the layers are
  scanned and split into whole stage x repeat groups of pattern units, and the batch into
  the microbatches.
  """
  S, R, M, axis = options.stages, options.repeats, options.microbatches, options.axis
  graphdef, params, others = nnx.split(layers, nnx.Param, ...)
  count = jax.tree.leaves(params)[0].shape[0]
  K = count // (S * R)
  if inputs is None:
    inputs = jnp.zeros((count, 0))
  streams = jax.tree.map(lambda x: _microbatches(x, M), carry)
  fill = options.bubble_fill

  def run_stage(stage_params, stage_others, repeat, x, stage_inputs):
    """K layers of one repeat on one microbatch -> (carry, per-layer outputs, new others)."""
    # One repeat (GPipe): the whole stack, statically, so the backward pass reads the weights
    # from the stage's stack itself rather than from per-iteration copies.
    pick = lambda tree: tree if R == 1 else jax.tree.map(  # noqa: E731
        lambda a: a.reshape(R, K, *a.shape[1:])[repeat], tree)
    weights = jax.tree.map(lambda w: jax.ad_checkpoint.checkpoint_name(w, _WEIGHTS), pick(stage_params))
    module = nnx.merge(graphdef, weights, pick(stage_others))
    y, outputs = run_layers(module, layer_fns, x, pick(stage_inputs), scan=True, unroll=unroll)
    return y, outputs, nnx.state(module, nnx.Not(nnx.Param))

  if R > 1:
    # The repeat's weights are cut from the stage's stack inside a rematerialised region, so the
    # backward pass cuts them again instead of keeping one copy per iteration.
    run_stage = jax.checkpoint(run_stage, policy=jax.checkpoint_policies.save_anything_except_these_names(_WEIGHTS))

  def per_stage(stage_params, stage_others, stage_inputs, streams):
    stage = jax.lax.axis_index(axis)
    first = jax.tree.map(lambda a: a[0], streams)
    y_shape, out_shape, _ = jax.eval_shape(run_stage, stage_params, stage_others, 0, first, stage_inputs)
    outputs = jax.tree.map(lambda a: jnp.zeros((R,) + a.shape, a.dtype), out_shape)
    bubble = jax.tree.map(lambda a: jnp.full(a.shape, fill if jnp.issubdtype(a.dtype, jnp.floating) else 0,
                                             a.dtype), y_shape)
    shift = [(j, (j + 1) % S) for j in range(S)]

    def iteration(state, t):
      buffer, incoming, stage_others, outputs = state
      # What stage 0 receives now left stage S-1 one iteration ago: item t - S, back for its
      # next repeat (or done); it waits in its microbatch's slot of the buffer.
      back = t - S
      returned = (back >= 0) & (back < M * R)
      buffer = jax.tree.map(lambda b, x: _put(b, back % M, jnp.where(returned, x, b[back % M])),
                            buffer, incoming)
      item = t - stage
      valid = (item >= 0) & (item < M * R)
      repeat = jnp.clip(item // M, 0, R - 1)
      x = jax.tree.map(lambda b, x: jnp.where(stage == 0, b[t % M], x), buffer, incoming)
      x = jax.tree.map(lambda a: jnp.where(valid, a, jnp.zeros_like(a)), x)
      y, out, new_others = run_stage(stage_params, stage_others, repeat, x, stage_inputs)
      stage_others = jax.tree.map(
          lambda old, new: _put_repeat(old, repeat, R, jnp.where(valid, new, _take_repeat(old, repeat, R))),
          stage_others, new_others)
      outputs = jax.tree.map(lambda acc, o: _put(acc, repeat, acc[repeat] + jnp.where(valid, o, 0)),
                             outputs, out)
      y = jax.tree.map(lambda a, b: jnp.where(valid, a, b), y, bubble)
      return (buffer, jax.lax.ppermute(y, axis, shift), stage_others, outputs), None

    state = (streams, bubble, stage_others, outputs)
    (buffer, incoming, stage_others, outputs), _ = jax.lax.scan(
        iteration, state, jnp.arange(M * R + S - 1))
    # The last microbatch's last repeat left stage S-1 in the final iteration.
    buffer = jax.tree.map(lambda b, x: _put(b, M - 1, x), buffer, incoming)
    done = jax.lax.psum(jax.tree.map(lambda b: jnp.where(stage == 0, b, jnp.zeros_like(b)), buffer), axis)
    outputs = jax.tree.map(lambda a: (a / M).reshape(R * K, *a.shape[2:]), outputs)
    return done, outputs, stage_others

  stacked = PartitionSpec(axis)
  # check_vma=False: with JAX 0.10.2's per-value tracking on here, every value inside varies
  # over `stage`, and autodiff of a kernel's shard_map nested in the stages (context attention,
  # MoE dispatch) names `stage` in its residuals' specs ahead of the kernel's own manual axes,
  # which Shardy rejects ("manual axis fsdp after free axis stage"). Off here, the nested
  # shard_maps track only their own axes. Nothing in the stages needs it: the only
  # collectives on `stage` are the ppermute hand-off and the final psum, whose transposes are
  # exact without it (the tests compare every gradient). Under train.sync's replica vmap the
  # replicas' axis is manual here too: vmap splits the batched inputs over it.
  done, outputs, new_others = jax.shard_map(
      per_stage, in_specs=(stacked, stacked, stacked, PartitionSpec()),
      out_specs=(PartitionSpec(), stacked, stacked), axis_names={axis, *vmapped_mesh_axes()}, check_vma=False)(
          params, others, inputs, streams)
  nnx.update(layers, new_others)
  return jax.tree.map(_merge_microbatches, done), outputs


def _put(buffer, index, value):
  return jax.lax.dynamic_update_index_in_dim(buffer, value.astype(buffer.dtype), index, 0)


def _take_repeat(stack, repeat, repeats):
  """The K layers of `repeat` from a stage's [R*K, ...] stack."""
  per = stack.shape[0] // repeats
  return jax.lax.dynamic_slice_in_dim(stack, repeat * per, per, 0)


def _put_repeat(stack, repeat, repeats, value):
  per = stack.shape[0] // repeats
  return jax.lax.dynamic_update_slice_in_dim(stack, value.astype(stack.dtype), repeat * per, 0)
