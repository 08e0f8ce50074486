"""TPU chips and slices: per-chip HBM, bf16 peak and link bandwidths; slice names to
libtpu topology names; the (CPU-host) devices of a topology to compile for."""

import re
from dataclasses import dataclass

from jax.experimental import topologies

from jaxpar.errors import ConfigError
from jaxpar.host import prepare_topology_compile

GB = 1e9
GIB = 2 ** 30


@dataclass(frozen=True)
class Chip:
  name: str
  hbm_bytes: float
  peak_flops: float  # dense bf16 FLOP/s per chip
  hbm_bandwidth: float  # bytes/s
  ici_bandwidth: float  # bidirectional bytes/s per chip
  dcn_bandwidth: float  # bytes/s per chip across slices
  dims: int  # torus dimensions: 2 (v5e, v6e) or 3 (v5p)
  cores_per_chip: int  # what the slice name counts per chip (v5p names count TensorCores)
  int8_flops: float | None = None  # dense int8 OP/s per chip (None: int8 dots at the bf16 peak)


# HBM is taken as GiB: the pages mix GB and GiB, and the compiler's own limit on v5e is
# 15.75 GiB available of 16 GiB (seen in its out-of-memory message).
CHIPS = {
  # https://cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16 (394 TOPs int8), 16 GB HBM at
  # 819 GBps, 400 GBps ICI per chip, 2 x 100 Gbps NICs per 8-chip host (= 25 Gbps per chip).
  "v5e": Chip("v5e", 16 * GIB, 197e12, 819 * GB, 400 * GB, 25e9 / 8, 2, 1, 394e12),
  # https://cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16 (918 TOPs int8), 95 GiB HBM at
  # 2765 GBps, 1200 GBps ICI per chip, 50 Gbps DCN per chip; a chip is 2 TensorCores (megacore).
  "v5p": Chip("v5p", 95 * GIB, 459e12, 2765 * GB, 1200 * GB, 50e9 / 8, 3, 2, 918e12),
  # https://cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16 (1836 TOPs int8), 32 GB HBM at
  # 1638 GBps, 800 GBps ICI per chip. DCN per chip is not published there: v5e's 25 Gbps is assumed.
  "v6e": Chip("v6e", 32 * GIB, 918e12, 1638 * GB, 800 * GB, 25e9 / 8, 2, 1, 1836e12),
}

# Chips in a slice -> torus shape, as in the tables of the pages above.
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16"}


def parse_slice(name: str) -> tuple[Chip, str]:
  """`v5p-128` (marketing name) or `v5p:4x4x4` (libtpu name) -> (chip, libtpu topology name)."""
  match = re.fullmatch(r"(v5e|v5p|v6e)([-:])([0-9x]+)", name)
  if not match:
    raise ConfigError(f"topology {name!r} is not like v6e-256 or v5p:4x4x4; chips: {sorted(CHIPS)}")
  chip, sep, size = CHIPS[match[1]], match[2], match[3]
  if sep == ":":
    return chip, name
  shapes = _SHAPES_3D if chip.dims == 3 else _SHAPES_2D
  count = int(size) // chip.cores_per_chip
  if int(size) % chip.cores_per_chip or count not in shapes:
    sizes = sorted(n * chip.cores_per_chip for n in shapes)
    raise ConfigError(f"topology {name!r}: no {chip.name} slice of that size; use one of "
                     f"{', '.join(f'{chip.name}-{n}' for n in sizes)}")
  return chip, f"{chip.name}:{shapes[count]}"


def topology_devices(name: str, num_slices: int = 1) -> tuple[Chip, list]:
  """The chip and the devices of `num_slices` slices of `name`, for compiling on a CPU host
  (libtpu must be installed; the CPU backend compiles)."""
  prepare_topology_compile()
  chip, libtpu_name = parse_slice(name)
  try:
    # One chip is smaller than libtpu's default host (2x2): it needs a one-chip host.
    single = {"chips_per_host_bounds": (1, 1, 1)} if libtpu_name.endswith(":1x1") else {}
    topology = topologies.get_topology_desc(platform="tpu", topology_name=libtpu_name,
                                            num_slices=num_slices, **single)
  except Exception as e:  # missing libtpu raises various types; say what to install
    raise ConfigError(f"cannot describe TPU topology {libtpu_name} ({e}); install libtpu: "
                     "pip install 'jaxpar[tpu]'") from None
  return chip, list(topology.devices)
