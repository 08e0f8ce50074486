"""Fitting tiles to arrays: check a tile, clamp it to the sequence, pad the sequence to it.
Shared by every kernel family."""

import jax.numpy as jnp

from jaxpar.errors import UserError


def round_up(n, multiple):
  return -(-n // multiple) * multiple


def fit_block(block, length, align):
  """The tile to use for `length` tokens: no longer than the (aligned) sequence."""
  return min(block, round_up(length, align))


def dividing_block(length, block, align):
  """The largest multiple of `align`, at most `block`, that divides `length` (the whole
  `length` when it fits in one block), or None: a tile that needs no padding. Padding
  activations is cheap; padding a weight would copy it on every call."""
  if length <= block:
    return length
  for size in range(block - block % align, 0, -align):
    if length % size == 0:
      return size
  return None


def pad_axis(x, axis, length):
  """Zero-pad axis `axis` of x up to `length` (None passes through)."""
  if x is None or x.shape[axis] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths)


def padded_segments(q_seg, kv_seg, q_pad, kv_pad):
  """Query and key segment ids padded to [B, q_pad] / [B, kv_pad] as int32 (None, None
  without segments)."""
  if q_seg is None:
    return None, None
  return (pad_axis(q_seg.astype(jnp.int32), 1, q_pad), pad_axis(kv_seg.astype(jnp.int32), 1, kv_pad))


def fit_tiles(blocks, q_len, kv_len, align, power_of_two=False) -> dict[str, int]:
  """Check the forward and backward tiles of `blocks` (BlockSizes) and fit each to its
  sequence: {"block_q", "block_k", "block_q_bwd", "block_k_bwd"}."""
  tiles = {}
  for name, block, length in (("block_q", blocks.block_q, q_len),
                              ("block_k", blocks.block_k, kv_len),
                              ("block_q_bwd", blocks.bwd.block_q, q_len),
                              ("block_k_bwd", blocks.bwd.block_k, kv_len)):
    check_block(name, block, align, power_of_two=power_of_two)
    tiles[name] = fit_block(block, length, align)
  return tiles


def check_block(name, block, align, power_of_two=False):
  """A tile length must be a positive multiple of the hardware alignment."""
  if not isinstance(block, int) or block <= 0 or block % align:
    raise UserError(f"{name}={block!r} must be a positive multiple of {align} on this backend")
  if power_of_two and block & (block - 1):
    raise UserError(f"{name}={block} must be a power of two for the Triton kernels")
