"""What a quantized matmul reads: integer weight values, scales and optional zero points.

`QuantizedWeight` is a pytree (arrays are leaves, mode and group size static), so it
passes through jit, shard_map and Orbax like any tree of arrays. For a [K, N] weight:

| mode   | values                       | scales       | zeros          | weight it stands for      |
| ------ | ---------------------------- | ------------ | -------------- | ------------------------- |
| int8   | int8 [K, N]                  | f32 [1, N]   | -              | values * scales (W8A16)   |
| int4   | int8 [K/2, N], 2 per byte    | f32 [K/G, N] | f32 [K/G, N]   | (nibble - zeros) * scales |
| w8a8   | int8 [K, N]                  | f32 [1, N]   | -              | values * scales           |

int4 nibbles are unsigned (0..15), packed planar within each group of G rows along K
(`packing.py` says why); without zeros the zero point is 8 (symmetric). w8a8 also
quantizes the activations per token, on the fly, and multiplies int8 by int8 into int32.
"""

import dataclasses

import jax

from jaxpar.errors import UserError
from jaxpar.pallas_kernels import tiling

MODES = ("int8", "int4", "w8a8")
GROUP_SIZES = (32, 64, 128)
INT4_SYMMETRIC_ZERO = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  values: jax.Array
  scales: jax.Array
  zeros: jax.Array | None = None
  mode: str = dataclasses.field(default="int8", metadata=dict(static=True))
  group_size: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, int]:
    """(K, N) of the weight it stands for."""
    rows, cols = self.values.shape
    return (rows * 2 if self.mode == "int4" else rows), cols

  @property
  def nbytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def check_group_size(mode: str, group_size, k: int):
  """The group size a mode needs, checked against the contracted dimension K."""
  if mode not in MODES:
    raise UserError(f"mode={mode!r} is not one of {MODES}")
  if mode != "int4":
    if group_size is not None:
      raise UserError(f"group_size={group_size} applies to mode='int4' only; mode={mode!r} "
                       "uses one scale per output channel (leave group_size unset)")
    return
  if group_size not in GROUP_SIZES:
    raise UserError(f"group_size={group_size!r} must be one of {GROUP_SIZES} for mode='int4'")
  if k % group_size:
    fits = [g for g in GROUP_SIZES if k % g == 0] or f"none of {GROUP_SIZES}"
    raise UserError(f"group_size={group_size} does not divide K={k}: pick a group size "
                     f"that divides it ({fits})")


def check_weight(w: QuantizedWeight):
  """Shapes and dtypes of a QuantizedWeight agree with its mode (names the bad field)."""
  check_group_size(w.mode, w.group_size, w.shape[0])
  k, n = w.shape
  if w.values.ndim != 2 or w.values.dtype != jax.numpy.int8:
    raise UserError(f"values must be a 2-D int8 array, got {w.values.dtype} {w.values.shape}")
  groups = k // w.group_size if w.mode == "int4" else 1
  if w.scales.shape != (groups, n):
    raise UserError(f"scales has shape {w.scales.shape}; mode={w.mode!r} with K={k}, N={n} "
                     f"needs {(groups, n)}")
  if w.zeros is not None and (w.mode != "int4" or w.zeros.shape != w.scales.shape):
    raise UserError(f"zeros (shape {w.zeros.shape}) must match scales {w.scales.shape} and "
                     "only mode='int4' takes them")


def pad_weight(w: QuantizedWeight, k: int, n: int) -> QuantizedWeight:
  """Zero rows/columns up to [k, n]: padded rows and columns contribute nothing."""
  per_row = 2 if w.mode == "int4" else 1
  groups = k // w.group_size if w.mode == "int4" else 1
  pad = lambda a, rows: None if a is None else tiling.pad_axis(tiling.pad_axis(a, 0, rows), 1, n)
  return dataclasses.replace(w, values=pad(w.values, k // per_row), scales=pad(w.scales, groups),
                             zeros=pad(w.zeros, groups))
