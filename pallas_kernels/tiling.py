"""Fitting tiles to sequences: clamp the tile to the sequence, pad the sequence to the tile."""

import jax.numpy as jnp


def round_up(n, multiple):
  return -(-n // multiple) * multiple


def fit_block(block, length, align):
  """The tile to use for `length` tokens: no longer than the (aligned) sequence."""
  return min(block, round_up(length, align))


def pad_axis(x, axis, length):
  """Zero-pad axis `axis` of x up to `length` (None passes through)."""
  if x is None or x.shape[axis] == length:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, widths)
