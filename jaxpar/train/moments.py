"""Optimizer moments stored narrower than f32 (`train.optimizer_state_dtype`).

The optimizer (optax's) computes in f32 as always; between steps, every state leaf that
mirrors a parameter (AdamW's first and second moments, Lion's and SGD's momentum) is stored as:

- bfloat16: the moment rounded to bf16 (2 bytes per value);
- int8_blockwise: 8 bits per value with one f32 scale per block of 128 values along one axis,
  as 8-bit Adam stores its moments. The code is not linear: a first moment m stores
  round(127 * sign(m) * sqrt(|m| / absmax)) and a second moment v (never negative)
  round(255 * (v / absmax) ** (1/4)), so values far below their block's largest keep a code
  above zero. A linear code rounds most of a block of second moments to zero, and Adam's
  m / (sqrt(v) + eps) then blows up.

Each parameter's moments are blocked along its last axis that is not `embed` (the axis FSDP
splits, finely, under the shipped rules), preferring one 128 divides: q [embed, heads,
head_dim] along head_dim, down [layers, mlp, embed] along mlp. So the blocks of a moment
split across devices as the parameter does, and the choice depends on the model alone: a
checkpoint restores onto any mesh. Step counts and scalars stay as they are. Each step decodes,
updates and encodes again: the f32 moments exist only inside the compiled step.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxpar.train.optim import path_names

BLOCK = 128
DTYPES = ("float32", "bfloat16", "int8_blockwise")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockwiseMoment:
  """A moment in 8 bits: codes (the moment's shape; int8 signed, uint8 for second moments) and
  f32 scales (its shape with `axis` cut to the number of blocks: each block's absolute maximum)."""
  codes: jax.Array
  scales: jax.Array
  axis: int = dataclasses.field(metadata=dict(static=True))


def block_axis(shape, names) -> int:
  """The axis to block a parameter of `shape` with logical axis `names` along."""
  candidates = [a for a in range(len(shape)) if names[a] != "embed"] or list(range(len(shape)))
  divisible = [a for a in candidates if shape[a] % BLOCK == 0]
  return (divisible or candidates)[-1]


def _blocked(x, axis: int):
  """x with `axis` split into (blocks, block): BLOCK where it divides the axis, else one block."""
  size = x.shape[axis]
  block = BLOCK if size % BLOCK == 0 else size
  return x.reshape(*x.shape[:axis], size // block, block, *x.shape[axis + 1:])


def encode_blockwise(x, axis: int, non_negative: bool) -> BlockwiseMoment:
  blocks = _blocked(x.astype(jnp.float32), axis)
  absmax = jnp.max(jnp.abs(blocks), axis=axis + 1, keepdims=True)
  unit = blocks / jnp.where(absmax > 0, absmax, 1.0)
  if non_negative:
    codes = jnp.round(255 * unit ** 0.25).astype(jnp.uint8)
  else:
    codes = jnp.round(127 * jnp.sign(unit) * jnp.sqrt(jnp.abs(unit))).astype(jnp.int8)
  return BlockwiseMoment(codes.reshape(x.shape), jnp.squeeze(absmax, axis + 1), axis)


def decode_blockwise(moment: BlockwiseMoment):
  codes = _blocked(moment.codes, moment.axis).astype(jnp.float32)
  if moment.codes.dtype == jnp.uint8:
    unit = (codes / 255) ** 4
  else:
    unit = jnp.sign(codes) * (codes / 127) ** 2
  return (unit * jnp.expand_dims(moment.scales, moment.axis + 1)).reshape(moment.codes.shape)


def _is_second_moment(path) -> bool:
  return any(getattr(key, "name", None) == "nu" for key in path)


def narrow_moments(inner: optax.GradientTransformation, dtype: str, abstract_params,
                   axis_names) -> optax.GradientTransformation:
  """`inner` with the state leaves that mirror a parameter (their path ends with its path, and
  they have its shape) stored in `dtype` (one of DTYPES) between steps. axis_names: the
  parameters' logical axis names (Runtime.axis_names)."""
  if dtype == "float32":
    return inner
  names = jax.tree.leaves(axis_names, is_leaf=lambda x: isinstance(x, tuple))
  layouts = {path_names(path): (tuple(leaf.shape), block_axis(leaf.shape, axes))
             for (path, leaf), axes in zip(jax.tree_util.tree_leaves_with_path(abstract_params), names)}

  def mirrored(path, leaf):
    """The blocked axis of the parameter `leaf` mirrors, else None."""
    names = path_names(path)
    found = next((layouts[names[i:]] for i in range(len(names)) if names[i:] in layouts), None)
    floating = jnp.issubdtype(getattr(leaf, "dtype", jnp.int32), jnp.floating)
    return found[1] if found and floating and tuple(leaf.shape) == found[0] else None

  def encode(state):
    def one(path, leaf):
      axis = mirrored(path, leaf)
      if axis is None:
        return leaf
      if dtype == "bfloat16":
        return leaf.astype(jnp.bfloat16)
      return encode_blockwise(leaf, axis, non_negative=_is_second_moment(path))
    return jax.tree_util.tree_map_with_path(one, state)

  def decode(state):
    def one(path, leaf):
      if isinstance(leaf, BlockwiseMoment):
        return decode_blockwise(leaf)
      return leaf.astype(jnp.float32) if mirrored(path, leaf) is not None else leaf
    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, BlockwiseMoment))

  def init(params):
    return encode(inner.init(params))

  def update(updates, state, params=None):
    updates, state = inner.update(updates, decode(state), params)
    return updates, encode(state)

  return optax.GradientTransformation(init, update)
