"""Replicas that train apart and sync now and then: DiLoCo, Streaming DiLoCo, SparseLoCo.

Each of the `data` axis's R replicas takes inner steps on its share of the batch with the
usual optimizer (its own state), and nothing crosses `data` between syncs: the inner step
is the plain train step under `jax.vmap(..., spmd_axis_name="data")` over parameters
stacked [R, ...] and split over `data`, with `batch` no longer mapped to `data` inside it,
so XLA's partitioner places each replica's work on its own devices (FSDP, tensor, context,
expert and pipeline stages still split inside a replica; their shard_maps batch under the
vmap). Every `every` steps a fragment (everything, for diloco and sparseloco) syncs, in the
same program as that step's inner update:

  delta_r   = anchor - replica_r          the pseudo-gradient, from the parameters before
                                          this step's inner update with `overlap` 1 (so the
                                          exchange does not wait for the step's compute and
                                          the scheduler can run them together), after it with 0
  sent_r    = delta_r, quantized (bits < 16) or top-k + quantized with error feedback (sparseloco:
              acc_r = error_decay acc_r + delta_r, sent_r = compress(acc_r), acc_r -= decode(sent_r))
  mean      = the replicas' average of sent_r: an all-reduce at 32 or 16 bits, otherwise an
              all-gather of the packed codes, each device decoding and averaging them
  m         = momentum m + mean;   anchor -= outer_lr (mean + momentum m)   (Nesterov SGD)
  replica_r = mixing replica_r + (1 - mixing) anchor

The train state keeps the anchor (the synced model: what is evaluated, saved as `params`
and exported) and, in `opt_state`, the replicas' parameters and inner optimizer states,
the outer momentum and SparseLoCo's error buffers, all saved, so a resume continues bit
for bit. Checkpoints hold R replicas: restoring onto another replica count is refused in
one line (averaging them would silently change the run; the anchor alone is the model).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.errors import ConfigError
from jaxpar.mesh.shard_map import vmapped_over_mesh_axis
from jaxpar.train.replicas import compress
from jaxpar.train.replicas.fragments import Fragments, put, take
from jaxpar.train.state import TrainState

AXIS = "data"


def _stacked(sharding):
  return NamedSharding(sharding.mesh, PartitionSpec(AXIS, *sharding.spec))


def _first_axis_shards(sharding) -> int:
  """How many devices a parameter's first axis (a stack's layers) is split over."""
  spec = tuple(sharding.spec)
  axes = spec[0] if spec and spec[0] else ()
  axes = (axes,) if isinstance(axes, str) else axes
  return int(np.prod([sharding.mesh.shape[a] for a in axes]))


def _without_data(rules):
  """The rules inside a replica: nothing maps to `data` (vmap's spmd_axis_name holds it)."""
  return tuple((name, tuple(a for a in axes if a != AXIS)) for name, axes in rules)


class ReplicaTraining:
  """The programs and state layout of train.sync != allreduce for one Trainer.

  update: the train step's body (jaxpar/train/step.py make_update); optimizer: the inner
  optimizer; shardings: the all-reduce TrainState's shardings; abstract_params, axis_names:
  the trained parameters' shapes and logical axis names; batch_shardings, compiler_options:
  as the all-reduce step is compiled with."""

  def __init__(self, config, runtime, update, optimizer, shardings: TrainState, abstract_params, axis_names,
               batch_shardings, compiler_options=None):
    train = config.train
    self.method = train.sync
    self.settings = train.diloco.resolved(train.sync)
    self.mesh = runtime.mesh
    self.replicas = self.mesh.shape[AXIS]
    if self.replicas == 1:
      raise ConfigError(f"train.sync={train.sync} syncs replicas over the `data` mesh axis, which has 1 device: "
                        "set mesh.data to the number of replicas (e.g. mesh.data=4)")
    if jax.tree.leaves(runtime.abstract_model_state):
      raise ConfigError(f"train.sync={train.sync}: this model keeps non-parameter state (router biases) that the "
                        "replicas would update apart: use train.sync=allreduce")
    if config.data.global_batch_size % self.replicas:
      raise ConfigError(f"data.global_batch_size={config.data.global_batch_size} does not split over "
                        f"{self.replicas} replicas: make it a multiple of mesh.data")
    self.update, self.optimizer = update, optimizer
    self.batch_shardings, self.compiler_options = batch_shardings, compiler_options
    self.rules = _without_data(runtime.rules)
    self.base = shardings
    self.shapes = [tuple(a.shape) for a in jax.tree.leaves(abstract_params)]
    names = jax.tree.leaves(axis_names, is_leaf=lambda x: isinstance(x, tuple))
    self.fragments = Fragments(names, self.shapes, self.settings.fragments,
                               [_first_axis_shards(sh) for sh in jax.tree.leaves(shardings.params)])
    self._programs, self._used = {}, set()

  # -- state ------------------------------------------------------------------------

  def opt_state_shardings(self) -> dict:
    b = self.base
    out = {"inner": jax.tree.map(_stacked, b.opt_state), "replicas": jax.tree.map(_stacked, b.params),
           "momentum": b.params}
    if self.method == "sparseloco":
      out["error"] = jax.tree.map(_stacked, b.params)
    return out

  def init_opt_state(self, params) -> dict:
    """Every replica starts at the anchor, with a fresh inner optimizer and no momentum."""
    def tile(x):
      return jnp.broadcast_to(x, (self.replicas, *x.shape))
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    state = {"inner": jax.tree.map(tile, self.optimizer.init(params)), "replicas": jax.tree.map(tile, params),
             "momentum": zeros}
    if self.method == "sparseloco":
      state["error"] = jax.tree.map(tile, zeros)
    return state

  def check_restore(self, source):
    """One line when a checkpoint (a weights.SavedRun) holds another number of replicas: the
    replicas have drifted apart, and averaging them would quietly change the run."""
    counts = {shape[0] for name, shape in source.stored_shapes("opt_state").items() if name.startswith("replicas.")}
    if counts and counts != {self.replicas}:
      raise ConfigError(f"checkpoint {source.path} holds {counts.pop()} train.sync replicas but mesh.data is "
                        f"{self.replicas}: they drifted apart, and merging or splitting them would change the run; "
                        "resume with mesh.data set to the replica count it was saved with")

  # -- programs ---------------------------------------------------------------------

  def due(self, step: int) -> int | None:
    """The fragment that syncs after inner step `step`, if one does."""
    return self.fragments.due(step, self.settings.every)

  def first_use(self, step: int) -> bool:
    """Whether step `step` is the first to run its program (so its time includes compiling it)."""
    fragment = self.due(step)
    fresh = fragment not in self._used
    self._used.add(fragment)
    return fresh

  def program(self, fragment: int | None):
    """The jitted step that takes an inner step and, with a fragment, syncs it."""
    if fragment not in self._programs:
      state_shardings = self.base.replace(opt_state=self.opt_state_shardings())
      self._programs[fragment] = jax.jit(functools.partial(self._step, fragment=fragment),
                                         in_shardings=(state_shardings, self.batch_shardings),
                                         out_shardings=(state_shardings, None), donate_argnums=0,
                                         compiler_options=self.compiler_options)
    return self._programs[fragment]

  def programs(self) -> dict:
    """Every program this run uses: {"inner": ..., "sync <p>": ...} (for compiling ahead of time)."""
    return {"inner": self.program(None),
            **{f"sync {p}": self.program(p) for p in range(self.settings.fragments)}}

  def _step(self, state: TrainState, batch, *, fragment):
    opt = state.opt_state
    split = jax.tree.map(lambda x: x.reshape(self.replicas, x.shape[0] // self.replicas, *x.shape[1:]), batch)
    inner = jax.vmap(self.update, in_axes=(0, 0, None, None, None, 0), out_axes=(0, 0, None, 0),
                     spmd_axis_name=AXIS)
    with nnx.logical_axis_rules(self.rules), vmapped_over_mesh_axis(AXIS):
      replicas, inner_state, model_state, metrics = inner(opt["replicas"], opt["inner"], state.model_state,
                                                          state.frozen, state.step, split)
    opt = {**opt, "inner": inner_state, "replicas": replicas}
    params = state.params
    if fragment is not None:
      source = state.opt_state["replicas"] if self.settings.overlap else replicas
      params, opt, sync_metrics = self._sync(fragment, params, source, opt)
      metrics = {**metrics, **sync_metrics}
    return state.replace(step=state.step + 1, params=params, opt_state=opt, model_state=model_state), metrics

  def _sync(self, fragment, anchor, source, opt):
    s = self.settings
    parts = self.fragments.parts(fragment, self.shapes)
    specs = [tuple(sh.spec) + (None,) * (len(shape) - len(sh.spec))
             for sh, shape in zip(jax.tree.leaves(self.base.params), self.shapes)]
    leaves = [jax.tree.leaves(t) for t in (anchor, source, opt["replicas"], opt["momentum"], opt.get("error", {}))]
    anchor_l, source_l, replica_l, momentum_l, error_l = leaves
    sent_sq, mean_sq, norm_sq = 0.0, 0.0, 0.0
    new = {"anchor": list(anchor_l), "replicas": list(replica_l), "momentum": list(momentum_l),
           "error": list(error_l)}
    for i, part in enumerate(parts):
      if part is None:
        continue
      a = take(anchor_l[i], part).astype(jnp.float32)
      delta = a[None] - take(source_l[i], part, axis=1).astype(jnp.float32)
      if self.method == "sparseloco":
        delta = s.error_decay * take(error_l[i], part, axis=1) + delta
      mean, each_sq, error = self._exchange(delta, specs[i])
      if error is not None:
        new["error"][i] = put(error_l[i], error, part, axis=1)
      m = s.outer_momentum * take(momentum_l[i], part) + mean
      a = a - s.outer_learning_rate * (mean + s.outer_momentum * m)
      mixed = s.mixing * take(replica_l[i], part, axis=1) + (1 - s.mixing) * a[None]
      new["anchor"][i] = put(anchor_l[i], a, part)
      new["momentum"][i] = put(momentum_l[i], m, part)
      new["replicas"][i] = put(replica_l[i], mixed, part, axis=1)
      sent_sq, mean_sq = sent_sq + each_sq, mean_sq + jnp.sum(jnp.square(mean))
      norm_sq = norm_sq + jnp.sum(jnp.square(a))
    treedef = jax.tree.structure(anchor)
    opt = {**opt, "replicas": jax.tree.unflatten(treedef, new["replicas"]),
           "momentum": jax.tree.unflatten(treedef, new["momentum"])}
    if "error" in opt:
      opt["error"] = jax.tree.unflatten(treedef, new["error"])
    # The replicas' RMS distance from their mean, relative to the anchor: from what they sent.
    drift = jnp.sqrt(jnp.maximum(jnp.mean(sent_sq) - mean_sq, 0.0) / jnp.maximum(norm_sq, 1e-30))
    return jax.tree.unflatten(treedef, new["anchor"]), opt, {"sync/drift": drift,
                                                               "sync/fragment": jnp.float32(fragment)}

  def _exchange(self, delta, spec):
    """(the replicas' mean of what they send, [R] squared norms of what each sent, the new
    error buffer or None) for one leaf's [R, ...] pseudo-gradients; `spec`: how the leaf is
    split inside a replica."""
    s = self.settings
    if s.bits >= 16 and self.method != "sparseloco":
      sent = delta.astype(jnp.float32 if s.bits == 32 else jnp.bfloat16)
      each_sq = jnp.sum(jnp.square(sent.astype(jnp.float32)), axis=tuple(range(1, sent.ndim)))
      return jnp.mean(sent, axis=0).astype(jnp.float32), each_sq, None
    mean, mine = jax.shard_map(self._send_codes, mesh=self.mesh, in_specs=PartitionSpec(AXIS, *spec),
                               out_specs=(PartitionSpec(*spec), PartitionSpec(AXIS, *spec)), check_vma=False)(delta)
    each_sq = jnp.sum(jnp.square(mine), axis=tuple(range(1, mine.ndim)))
    return mean, each_sq, delta - mine if self.method == "sparseloco" else None

  def _send_codes(self, delta):
    """Per device (shard_map: the partitioner would regroup the flattened rows across
    devices, `data` included): compress this device's shard of its replica's
    pseudo-gradient, all-gather the codes over `data` alone, decode and average them.
    Returns (the mean, what this replica sent, decoded)."""
    s = self.settings
    options = {"bits": s.bits, "chunk": s.chunk}
    if self.method == "sparseloco":
      payload = compress.sparsify(delta, kept=round(s.density * s.chunk), **options)
    else:
      payload = compress.quantize(delta, **options)
    gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, AXIS, axis=0, tiled=True), payload)
    shape = delta.shape[1:]
    return (jnp.mean(compress.decode(gathered, shape=shape, **options), axis=0),
            compress.decode(payload, shape=shape, **options))

  # -- reporting --------------------------------------------------------------------

  def host_metrics(self, metrics: dict) -> dict:
    """The replicas' per-replica metrics as one value each: tokens summed, the rest averaged."""
    out = {}
    for key, value in metrics.items():
      value = np.asarray(value)
      if value.ndim and value.shape[0] == self.replicas and not key.startswith("sync/"):
        value = value.sum(0) if key == "tokens" else value.mean(0)
      out[key] = value
    return out

  def sent_bytes(self, fragment: int) -> int:
    """Bytes each device sends its `data` peers at a sync of `fragment`: its shard of every
    leaf the fragment holds, as `compress` packs it (the hand count the compiled program's
    traffic is checked against)."""
    s = self.settings
    kept = round(s.density * s.chunk) if self.method == "sparseloco" else None
    total = 0
    shardings = jax.tree.leaves(self.base.params)
    for part, shape, sharding in zip(self.fragments.parts(fragment, self.shapes), self.shapes, shardings):
      if part is None:
        continue
      piece = (part.size(shape[0]), *shape[1:])
      size = int(np.prod(sharding.shard_shape(piece)))
      total += compress.payload_bytes(size, bits=s.bits, chunk=s.chunk, kept=kept)
    return total

  def least_wire_bytes(self, fragment: int) -> float:
    """What each device must send over `data` at a sync of `fragment` (ring algorithms): one
    all-reduce of its shard at 32 or 16 bits, else its packed codes to every other replica."""
    n = self.replicas
    dense = self.settings.bits >= 16 and self.method != "sparseloco"
    return self.sent_bytes(fragment) * (2 * (n - 1) / n if dense else n - 1)
