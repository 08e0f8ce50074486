"""Sub-byte integers packed into int8 bytes, planar within each group.

A group of `group` consecutive values along the packed axis (a weight's contracted K axis,
a KV entry's head_dim) takes group * bits / 8 bytes. With p = 8 / bits values per byte,
byte i of a group holds values i, i + group/p, ..., i + (p-1) group/p, lowest bits first:
for int4, the low nibble is a value from the first half of the group and the high nibble
the value group/2 further on.

Why planar halves rather than neighbour pairs (values 2i and 2i+1 in one byte, as GPTQ and
AWQ checkpoints store them):
- TPU: one shift-and-mask of a whole [G/2, N] byte tile yields a *contiguous* block of G/2
  rows; the two blocks stack along sublanes (16..64 rows, whole 8-row vreg tiles) while N
  stays on the 128 lanes, so unpacking needs no lane or sublane shuffle. Neighbour pairs
  would interleave rows, a sublane shuffle per tile.
- GPU: each unpacked block is a ready [G/2, bn] operand of one tensor-core dot (G/2 >= 16
  rows, the mma K granularity) against a contiguous activation slice x[:, g G : g G + G/2].
  MARLIN goes further and permutes weights into the mma register-fragment layout; Pallas
  Triton does not expose fragments, so this is the layout it can use without shuffles.
- Bytes never straddle a group, and groups never straddle a tensor-parallel shard (the
  scales carry the same axis name), so a K-split (row-parallel) weight splits on bytes.
"""

import jax.numpy as jnp


def values_per_byte(bits: int) -> int:
  if bits not in (2, 4, 8):
    raise ValueError(f"bits={bits} must be 2, 4 or 8")
  return 8 // bits


def pack(values, bits: int, axis: int, group: int):
  """Unsigned ints in [0, 2**bits) -> int8 bytes; `axis` shrinks by 8 / bits."""
  per = values_per_byte(bits)
  x = jnp.moveaxis(values.astype(jnp.int32), axis, -1)
  lead, n = x.shape[:-1], x.shape[-1]
  planes = x.reshape(*lead, n // group, per, group // per)
  packed = sum(planes[..., j, :] << (bits * j) for j in range(per))
  packed = packed.reshape(*lead, n // per)
  return jnp.moveaxis(packed.astype(jnp.uint8).view(jnp.int8), -1, axis)


def unpack(packed, bits: int, axis: int, group: int):
  """The inverse of `pack`: int8 bytes -> int32 in [0, 2**bits); `axis` grows by 8 / bits."""
  per = values_per_byte(bits)
  x = jnp.moveaxis(packed.astype(jnp.int32), axis, -1)  # sign-extended; masked below
  lead, n = x.shape[:-1], x.shape[-1]
  x = x.reshape(*lead, n // (group // per), 1, group // per)
  mask = (1 << bits) - 1
  planes = [(x >> (bits * j)) & mask for j in range(per)]
  return jnp.moveaxis(jnp.concatenate(planes, axis=-2).reshape(*lead, n * per), -1, axis)
