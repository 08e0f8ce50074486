"""Optimizer moments stored narrower than f32 (`train.optimizer_state_dtype`).

The optimizer (optax's) computes in f32 as always; between steps, every state leaf shaped like
a parameter (AdamW's first and second moments, Lion's and SGD's momentum) is stored as:

- bfloat16: the moment rounded to bf16 (2 bytes per value);
- int8_blockwise: 8 bits per value with one f32 scale per block of 128 along the last axis
  (the whole last axis where 128 does not divide it), as 8-bit Adam stores its moments.
  The code is not linear: a first moment m stores round(127 * sign(m) * sqrt(|m| / absmax))
  and a second moment v (never negative) round(255 * (v / absmax) ** (1/4)), so values far
  below their block's largest keep a code above zero. A linear code rounds most of a block
  of second moments to zero, and Adam's m / (sqrt(v) + eps) then blows up.

Step counts and scalars stay as they are. Each step decodes, updates and encodes again: the
f32 moments exist only inside the compiled step.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax

BLOCK = 128
DTYPES = ("float32", "bfloat16", "int8_blockwise")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockwiseMoment:
  """A moment in 8 bits: codes [*shape] (int8 signed, uint8 for second moments) and f32 scales
  [*shape[:-1], blocks] (each block's absolute maximum)."""
  codes: jax.Array
  scales: jax.Array


def _block(size: int) -> int:
  return BLOCK if size % BLOCK == 0 else size


def _blocked(x):
  *lead, last = x.shape
  return x.reshape(*lead, last // _block(last), _block(last))


def encode_blockwise(x, non_negative: bool) -> BlockwiseMoment:
  blocks = _blocked(x.astype(jnp.float32))
  absmax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  unit = blocks / jnp.where(absmax > 0, absmax, 1.0)
  if non_negative:
    codes = jnp.round(255 * unit ** 0.25).astype(jnp.uint8)
  else:
    codes = jnp.round(127 * jnp.sign(unit) * jnp.sqrt(jnp.abs(unit))).astype(jnp.int8)
  return BlockwiseMoment(codes.reshape(x.shape), absmax[..., 0])


def decode_blockwise(moment: BlockwiseMoment):
  codes = _blocked(moment.codes).astype(jnp.float32)
  if moment.codes.dtype == jnp.uint8:
    unit = (codes / 255) ** 4
  else:
    unit = jnp.sign(codes) * (codes / 127) ** 2
  return (unit * moment.scales[..., None]).reshape(moment.codes.shape)


def _is_second_moment(path) -> bool:
  return any(getattr(key, "name", None) == "nu" for key in path)


def narrow_moments(inner: optax.GradientTransformation, dtype: str, param_shapes) -> optax.GradientTransformation:
  """`inner` with its parameter-shaped state leaves stored in `dtype` (one of DTYPES) between
  steps. param_shapes: the set of the parameters' shapes (what a moment's shape is)."""
  if dtype == "float32":
    return inner
  mirrors = lambda leaf: (isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)  # noqa: E731
                          and jnp.issubdtype(leaf.dtype, jnp.floating) and tuple(leaf.shape) in param_shapes)

  def encode(state):
    def one(path, leaf):
      if not mirrors(leaf):
        return leaf
      if dtype == "bfloat16":
        return leaf.astype(jnp.bfloat16)
      return encode_blockwise(leaf, non_negative=_is_second_moment(path))
    return jax.tree_util.tree_map_with_path(one, state)

  def decode(state):
    def one(leaf):
      if isinstance(leaf, BlockwiseMoment):
        return decode_blockwise(leaf)
      return leaf.astype(jnp.float32) if getattr(leaf, "dtype", None) == jnp.bfloat16 else leaf
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, BlockwiseMoment))

  def init(params):
    return encode(inner.init(params))

  def update(updates, state, params=None):
    updates, state = inner.update(updates, decode(state), params)
    return updates, encode(state)

  return optax.GradientTransformation(init, update)
