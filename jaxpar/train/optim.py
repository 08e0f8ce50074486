"""Optimizers and learning-rate schedules (optax), chosen by name in `train:`.

optimizer: adamw | adafactor | lion | sgd (with momentum) | muon | galore. Every one clips the
global gradient norm first (train.grad_clip) and decays only the parameters that declare
`weight_decay` (norm scales do not). Muon is optax's: it orthogonalises the update of every
hidden weight matrix and hands the rest (embeddings, output projection, norm scales) to
AdamW, as its authors recommend; `consistent_rms=0.2` scales its updates to AdamW's size so
one train.learning_rate serves both. Its weight decay applies to the matrices. GaLore
(train/galore.py) is AdamW with each hidden matrix's moments in a low-rank projection.

schedule: cosine | linear | constant | wsd, each after a linear warm-up from 0; cosine and
linear decay to learning_rate * min_lr_ratio at train.steps, wsd (warmup-stable-decay) holds
the peak and decays linearly over the last train.decay_fraction of the steps.

The optimizer state is sharded like the parameters it mirrors (`opt_state_shardings`).
"""

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec
from optax import contrib

from jaxpar.train.galore import scale_by_galore
from jaxpar.train.matrices import STACKED, hidden_matrix


def learning_rate_schedule(train_cfg):
  t = train_cfg
  peak, end = t.learning_rate, t.learning_rate * t.min_lr_ratio
  steps = max(t.steps, 1)
  warmup = min(t.warmup_steps, max(t.steps - 1, 0))
  if t.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                              decay_steps=steps, end_value=end)
  ramp = optax.linear_schedule(0.0, peak, warmup)
  if t.schedule == "constant":
    return optax.join_schedules([ramp, optax.constant_schedule(peak)], [warmup])
  if t.schedule == "linear":
    return optax.join_schedules([ramp, optax.linear_schedule(peak, end, steps - warmup)], [warmup])
  decay = min(max(round(t.decay_fraction * steps), 1), steps - warmup)  # wsd
  stable = optax.constant_schedule(peak)
  return optax.join_schedules([ramp, stable, optax.linear_schedule(peak, end, decay)],
                              [warmup, steps - decay])


def muon_dimensions(axis_names: dict) -> dict:
  """Per parameter (a tree of logical axis-name tuples): the MuonDimensionNumbers of a hidden
  weight matrix, None for what AdamW takes (vocabulary tables, vectors). The input axes come
  first: `embed` when it leads (q, k, v, gate, up), otherwise everything before the output."""
  def dims(names):
    if not hidden_matrix(names):
      return None
    axes = [i for i, n in enumerate(names) if n not in STACKED]  # each stacked matrix on its own
    if names[axes[-1]] == "embed" and names[axes[0]] != "embed":
      return contrib.MuonDimensionNumbers(tuple(axes[:-1]), axes[-1])
    return contrib.MuonDimensionNumbers(axes[0], tuple(axes[1:]))
  return jax.tree.map(dims, axis_names, is_leaf=lambda x: isinstance(x, tuple))


def make_optimizer(train_cfg, decay_mask, axis_names=None) -> optax.GradientTransformation:
  """decay_mask: a params-shaped tree of bools, from each parameter's declared `weight_decay`
  (Runtime.decay_mask); axis_names: the params' logical axis names (Runtime.axis_names),
  which Muon needs to tell matrices from the rest. The global-norm clip, then update_rule's."""
  update = update_rule(train_cfg, decay_mask, axis_names)
  if train_cfg.grad_clip is None:
    return update
  return optax.chain(optax.clip_by_global_norm(train_cfg.grad_clip), update)


def update_rule(train_cfg, decay_mask, axis_names=None) -> optax.GradientTransformation:
  """train.optimizer's transformation of the clipped gradients into updates."""
  t, lr = train_cfg, learning_rate_schedule(train_cfg)
  if t.optimizer == "adamw":
    update = optax.adamw(lr, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=decay_mask)
  elif t.optimizer == "adafactor":
    update = optax.adafactor(lr, weight_decay_rate=t.weight_decay or None, weight_decay_mask=decay_mask)
  elif t.optimizer == "lion":
    update = optax.lion(lr, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask)
  elif t.optimizer == "sgd":
    update = optax.chain(optax.add_decayed_weights(t.weight_decay, decay_mask),
                         optax.sgd(lr, momentum=t.momentum if t.momentum is not None else 0.9))
  elif t.optimizer == "galore":
    g = t.galore
    update = optax.chain(scale_by_galore(axis_names, rank=g.rank, update_every=g.update_every, scale=g.scale,
                                         b1=t.b1, b2=t.b2, eps=t.eps),
                         optax.add_decayed_weights(t.weight_decay, decay_mask), optax.scale_by_learning_rate(lr))
  else:  # muon
    update = contrib.muon(lr, beta=t.momentum if t.momentum is not None else 0.95, eps=t.eps,
                          weight_decay=t.weight_decay, adam_b1=t.b1, adam_b2=t.b2,
                          muon_weight_dimension_numbers=muon_dimensions(axis_names), consistent_rms=0.2)
  return update


def path_names(path) -> tuple:
  return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def opt_state_shardings(abstract_opt_state, abstract_params, param_shardings, mesh):
  """Shardings for an optimizer state: a leaf that mirrors a parameter (its path ends with
  the parameter's) is sharded like it; a factored moment (the parameter's shape less one
  axis, Adafactor's row and column statistics) like it with that axis dropped; one of the
  parameter's rank with other sizes on some axes (an 8-bit moment's block scales,
  train/moments.py; GaLore's projection and projected moments, train/galore.py) like it on the
  axes of the parameter's size and whole on the others; the rest (step counts, scalars)
  replicated."""
  params = {path_names(p): (leaf.shape, s) for (p, leaf), s in zip(
      jax.tree_util.tree_leaves_with_path(abstract_params), jax.tree.leaves(param_shardings))}
  replicated = NamedSharding(mesh, PartitionSpec())

  def sharding(path, leaf):
    names = path_names(path)
    part = names[-1] if names and names[-1] in ("codes", "scales") else None
    names = names[:-1] if part else names
    found = next((params[names[i:]] for i in range(len(names)) if names[i:] in params), None)
    if found is None:
      return replicated
    shape, param_sharding = found
    spec = tuple(param_sharding.spec) + (None,) * (len(shape) - len(param_sharding.spec))
    if tuple(leaf.shape) == tuple(shape):
      return param_sharding
    for axis in reversed(range(len(shape))):  # the last axis first: Adafactor's row statistic
      if tuple(leaf.shape) == shape[:axis] + shape[axis + 1:]:
        return NamedSharding(mesh, PartitionSpec(*spec[:axis], *spec[axis + 1:]))
    if leaf.ndim == len(shape):  # split as the parameter where the sizes agree, whole elsewhere
      return NamedSharding(mesh, PartitionSpec(*(s if n == m else None for s, n, m in zip(spec, leaf.shape, shape))))
    return replicated
  return jax.tree_util.tree_map_with_path(sharding, abstract_opt_state)


def state_bytes_per_param(abstract_opt_state, num_params: int) -> float:
  """Optimizer-state bytes per model parameter (AdamW in float32: 8)."""
  total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_opt_state))
  return total / max(num_params, 1)
