"""What a replica sends at a sync: its pseudo-gradient, whole or compressed.

Every leaf travels as rows of `chunk` values (the flat leaf, zero-padded to whole rows), one
bfloat16 scale per row (its largest magnitude), and codes packed into bytes:

  quantized  every value, `bits` each: a uniform quantizer with 2**bits levels spread evenly
             over [-scale, scale] (no zero level: at 2 bits that is -s, -s/3, s/3, s).
  sparse     SparseLoCo: the `kept` largest-magnitude values of each row, quantized as above,
             and their positions in the row (uint8 up to 256-value rows, else uint16).

`decode` inverts either into float32 values. Arrays keep their leading axis (the replicas'),
and the codes pack along the last axis only, so they shard like the rows.
"""

import math

import jax
import jax.numpy as jnp


def rows(x, chunk: int):
  """[..., *shape] -> [..., ceil(size / chunk), chunk] float32, zero-padded."""
  lead = x.shape[:1]
  flat = x.reshape(*lead, -1).astype(jnp.float32)
  pad = -flat.shape[-1] % chunk
  if pad:
    flat = jnp.pad(flat, [(0, 0)] * len(lead) + [(0, pad)])
  return flat.reshape(*lead, -1, chunk)


def unrows(values, shape):
  """rows' inverse: [..., rows, chunk] -> [..., *shape] (the padding dropped)."""
  lead = values.shape[:1]
  flat = values.reshape(*lead, -1)[..., :math.prod(shape)]
  return flat.reshape(*lead, *shape)


def _pack(codes, bits: int):
  """uint8 codes below 2**bits, [..., n] -> [..., n * bits / 8] bytes."""
  per_byte = 8 // bits
  codes = codes.reshape(*codes.shape[:-1], -1, per_byte).astype(jnp.uint8)
  shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
  return jnp.sum(codes << shifts, axis=-1, dtype=jnp.uint8)  # the fields do not overlap: sum = or


def _unpack(packed, bits: int):
  per_byte = 8 // bits
  if per_byte == 1:
    return packed
  shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
  codes = (packed[..., None] >> shifts) & jnp.uint8(2 ** bits - 1)
  return codes.reshape(*packed.shape[:-1], -1)


def _levels(values, scale, bits: int):
  """(codes, step): values in [-scale, scale] to the nearest of 2**bits evenly spaced levels."""
  top = 2 ** bits - 1
  step = 2 * scale / top
  safe = jnp.where(step > 0, step, 1.0)
  codes = jnp.clip(jnp.round(values / safe + top / 2), 0, top)
  return codes.astype(jnp.uint8), step


def _value(codes, step, bits: int):
  return (codes.astype(jnp.float32) - (2 ** bits - 1) / 2) * step


def _scale(values):
  """A row's largest magnitude, rounded to bfloat16 (what travels) before any code uses it."""
  return jnp.max(jnp.abs(values), axis=-1, keepdims=True).astype(jnp.bfloat16).astype(jnp.float32)


def _bits_of(scale):
  """The bfloat16 scale as its 16 bits: a collective then moves 2 bytes (XLA would move a
  float conversion ahead of it and send 4)."""
  return jax.lax.bitcast_convert_type(scale.astype(jnp.bfloat16), jnp.uint16)


def quantize(x, *, bits: int, chunk: int) -> dict:
  """Every value of x (leading axis kept) at `bits` bits."""
  r = rows(x, chunk)
  scale = _scale(r)
  codes, _ = _levels(r, scale, bits)
  return {"codes": _pack(codes, bits), "scale": _bits_of(scale)}


def sparsify(x, *, bits: int, chunk: int, kept: int) -> dict:
  """The `kept` largest-magnitude values of each row of x, at `bits` bits, with their positions."""
  r = rows(x, chunk)
  _, index = jax.lax.top_k(jnp.abs(r), kept)
  values = jnp.take_along_axis(r, index, axis=-1)
  scale = _scale(values)
  codes, _ = _levels(values, scale, bits)
  return {"codes": _pack(codes, bits), "scale": _bits_of(scale),
          "index": index.astype(jnp.uint8 if chunk <= 256 else jnp.uint16)}


def decode(payload: dict, *, bits: int, chunk: int, shape) -> jax.Array:
  """float32 values [..., *shape] of a quantized or sparse payload."""
  scale = jax.lax.bitcast_convert_type(payload["scale"], jnp.bfloat16).astype(jnp.float32)
  step = 2 * scale / (2 ** bits - 1)
  values = _value(_unpack(payload["codes"], bits), step, bits)
  if "index" in payload:
    dense = jnp.zeros((*values.shape[:-1], chunk), jnp.float32)
    values = jnp.put_along_axis(dense, payload["index"].astype(jnp.int32), values, axis=-1, inplace=False)
  return unrows(values, shape)


def payload_bytes(size: int, *, bits: int, chunk: int, kept: int | None = None) -> int:
  """Bytes one replica sends for a leaf of `size` values: the hand count the compiled
  program's traffic is checked against (dense: size x bits / 8)."""
  if bits >= 16 and kept is None:
    return size * bits // 8
  count = -(-size // chunk)
  per_row = 2 + (chunk * bits // 8 if kept is None else kept * bits // 8 + kept * (1 if chunk <= 256 else 2))
  return count * per_row
