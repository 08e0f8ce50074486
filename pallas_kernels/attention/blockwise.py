"""What every blockwise attention implementation (flash TPU, flash GPU, chunked) exposes.

Each one is a `Blockwise` pair in the public layout, q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D],
taking the call's AttentionSpec (spec.py):

  forward(spec, q, k, v, sinks, q_seg, kv_seg, q_offset) -> (o [B, Lq, Hq, D], lse f32 [B, Hq, Lq])
  backward(spec, q, k, v, q_seg, kv_seg, q_offset, o, lse, do) -> (dq, dk, dv)

Query i sits at key position `q_offset + i` (an int32 scalar, traced or not): plain
attention passes `Lk - Lq`; context parallelism passes where a query chunk lies relative
to a key chunk that lives on another device. `backward` recomputes probabilities from the
`lse` it is given, so with the log-sum-exp of *all* keys it returns this key block's share
of the gradient: the ring sums those shares. Rows that see no key get o = 0 and a very
negative lse, which weighs nothing when blocks are combined. `sinks` ([Hq] or None) start
each row's online softmax at (max = sink, sum = 1): a key block of its own whose value is
zero. Context parallelism passes None per block and folds the sinks in once (`add_sinks`).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.attention.spec import AttentionSpec


@dataclasses.dataclass(frozen=True)
class Tiled:
  """What a blockwise kernel specialises on (hashable: a custom_vjp's static argument): the
  call's spec, the keys' length, the scale for this head dim and the tiles fitted to these
  shapes."""
  spec: AttentionSpec
  kv_len: int
  scale: float
  block_q: int
  block_k: int
  block_q_bwd: int
  block_k_bwd: int

  mask = property(lambda self: self.spec.mask)
  logit_soft_cap = property(lambda self: self.spec.logit_soft_cap)
  interpret = property(lambda self: self.spec.interpret)

  @classmethod
  def fit(cls, spec: AttentionSpec, defaults, q, k, align: int, power_of_two: bool = False) -> "Tiled":
    """Tiles of spec.block_sizes (else `defaults`) fitted to q's and k's lengths (Triton's
    rounded up to powers of two)."""
    tiles = tiling.fit_tiles(spec.block_sizes or defaults, q.shape[1], k.shape[1], align, power_of_two=power_of_two)
    if power_of_two:
      tiles = {name: 1 << (t - 1).bit_length() for name, t in tiles.items()}
    return cls(spec, k.shape[1], spec.scale_for(q.shape[-1]), **tiles)


@dataclasses.dataclass(frozen=True)
class Blockwise:
  forward: Callable
  backward: Callable


def split_segments(segment_ids, q_len):
  """[B, Lk] ids of the keys -> (query ids [B, Lq], key ids): queries are the last Lq keys."""
  if segment_ids is None:
    return None, None
  return segment_ids[:, segment_ids.shape[1] - q_len:], segment_ids


def default_offset(q, k):
  """Queries are the last Lq of the Lk keys."""
  return jnp.int32(k.shape[1] - q.shape[1])


def full_like_varying(shape, value, like, dtype=jnp.float32):
  """A constant array that varies over the same manual mesh axes as `like`: inside
  `shard_map`, loop carries must keep one type, and a constant starts out replicated."""
  x = jnp.full(shape, value, dtype)
  axes = tuple(sorted(jax.typeof(like).mat.varying))
  return lax.pcast(x, axes, to="varying") if axes else x


def out_struct(shape, dtype, like):
  """A kernel output's shape that varies over the same manual mesh axes as `like` (inside
  `shard_map`, Pallas must be told)."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def add_sinks(o, lse, sinks):
  """A finished attention (o [B, L, H, D], lse [B, H, L]) with the sinks [H] folded in as
  one more key of value zero -> (o in float32, lse); sinks None: as it is."""
  if sinks is None:
    return o, lse
  new_lse = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
  keep = jnp.exp(lse - new_lse).transpose(0, 2, 1)[..., None]  # [B, L, H, 1]
  return o.astype(jnp.float32) * keep, new_lse


def merge_partials(a, b):
  """Combine two partial attentions over disjoint sets of keys, each (o [B, L, H, D],
  lse [B, H, L]), into one (o in float32): the online softmax, one block at a time."""
  (o_a, lse_a), (o_b, lse_b) = a, b
  lse = jnp.logaddexp(lse_a, lse_b)
  weight = lambda part: jnp.exp(part - lse).transpose(0, 2, 1)[..., None]  # -> [B, L, H, 1]
  return (o_a.astype(jnp.float32) * weight(lse_a) + o_b.astype(jnp.float32) * weight(lse_b), lse)
