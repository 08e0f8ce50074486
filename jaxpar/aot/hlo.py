"""Collectives in compiled HLO text: kind, count and bytes, times while-loop trip counts.

A scanned layer stack compiles to one `while` whose body holds one layer's collectives;
counting them once (as `cost_analysis()` does for FLOPs) would miss all other layers, so
each computation is weighted by the trip counts of the loops that reach it. The TPU
compiler fuses collectives with their neighbours: fusions are searched too, and its
`all-reduce-scatter` fusion (an all-reduce whose result each device slices) counts as
the reduce-scatter it runs as.
"""

import math
import re
from dataclasses import dataclass

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) ")
_COLLECTIVE = re.compile(r"= (.+?) (" + "|".join(KINDS) + r")(-start)?\(")
# Multi-slice: libtpu lowers a DCN collective to a host-transfer send for the megascale runtime.
_MEGASCALE = re.compile(r"= \((.+?), u32\[\], token\[\]\) send\(.*"
                        r"_xla_megascale_transfer_type=\"(\w+)\"")
_CALLEE = re.compile(r"(body|condition|calls|to_apply|branch_computations)=\{?%([\w.\-]+)")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")


@dataclass
class Collective:
  kind: str
  count: int  # executions per step (loop trips included)
  bytes: int  # result bytes per device per step (for reduce-scatter: its input)
  wire_bytes: float  # bytes each device sends per step (ring algorithms)
  dcn: bool  # its groups span slices


def _array_bytes(shape_text: str) -> list[int]:
  sizes = []
  for dtype, dims in _ARRAY.findall(shape_text):
    if dtype in _DTYPE_BYTES:
      sizes.append(_DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d))
  return sizes


def _groups(line: str, num_devices: int) -> np.ndarray:
  """Replica groups as [num_groups, group_size] device indices (into the mesh's flat devices)."""
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line):
    axes = re.findall(r"'(\w+)'=(\d+)", m[1])
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    reduced = [names.index(a) for a in re.findall(r"'(\w+)'", m[2])]
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    kept = [i for i in range(len(sizes)) if i not in reduced]
    return ids.transpose(kept + reduced).reshape(-1, math.prod(sizes[i] for i in reduced))
  if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line):
    ids = np.arange(math.prod(int(d) for d in m[3].split(","))).reshape(
        [int(d) for d in m[3].split(",")])
    if m[4]:
      ids = ids.transpose([int(d) for d in m[4].split(",")])
    return ids.reshape(int(m[1]), int(m[2]))
  if m := re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line):
    return np.array([[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m[1])])
  if "source_target_pairs=" in line:
    pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])
    return np.array([[int(a), int(b)] for a, b in pairs])
  return np.arange(num_devices)[None]


def _split_computations(hlo: str) -> tuple[dict[str, list[str]], str]:
  computations, entry, current = {}, None, None
  for line in hlo.splitlines():
    if m := _COMPUTATION.match(line):
      current = m[1]
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif current is not None:
      computations[current].append(line)
  return computations, entry


def _trip_count(condition: list[str]) -> int:
  """A scan's condition ends in `ROOT compare(counter, N), direction=LT`: N is the trip count
  (1 when the condition has another form: better to undercount than to guess)."""
  constants = dict(re.findall(r"%([\w.\-]+) = s32\[\]\S* constant\((\d+)\)", "\n".join(condition)))
  root = next((line for line in condition if "ROOT" in line and "direction=LT" in line), "")
  operands = re.findall(r"%([\w.\-]+)", root.split("compare(", 1)[-1].split(")", 1)[0])
  return next((int(constants[o]) for o in operands if o in constants), 1)


def collectives(hlo: str, slice_of_device=None) -> list[Collective]:
  """Every collective op of the compiled module, weighted by loop trips.

  slice_of_device: slice index per flat mesh device (multi-slice), to flag DCN collectives.
  """
  computations, entry = _split_computations(hlo)
  num_devices = len(slice_of_device) if slice_of_device is not None else 1
  found: list[Collective] = []

  def visit(name: str, weight: int):
    for line in computations.get(name, ()):
      if m := _COLLECTIVE.search(line):
        found.append(_one(m, line, weight, num_devices, slice_of_device))
      elif m := _MEGASCALE.search(line):
        found.append(_dcn(m, weight, slice_of_device))
      callees = dict(_CALLEE.findall(line))
      if "body" in callees:
        trips = _trip_count(computations.get(callees["condition"], ()))
        visit(callees["body"], weight * trips)
      elif "calls" in callees and callees["calls"].startswith("all-reduce-scatter"):
        found.extend(_as_reduce_scatter(c) for c in _inner(callees["calls"], weight))
      elif "calls" in callees:
        visit(callees["calls"], weight)
      elif "branch_computations" in callees:
        for branch in re.findall(r"%([\w.\-]+)", line.split("branch_computations=")[1]):
          visit(branch, weight)

  def _inner(name: str, weight: int) -> list[Collective]:
    return [_one(m, line, weight, num_devices, slice_of_device)
            for line in computations.get(name, ()) if (m := _COLLECTIVE.search(line))]

  visit(entry, 1)
  return found


def _as_reduce_scatter(c: Collective) -> Collective:
  """An all-reduce that each device slices: bytes are its input, as for a reduce-scatter;
  on the wire it is half an all-reduce."""
  return Collective("reduce-scatter", c.count, c.bytes, c.wire_bytes / 2, c.dcn)


def _wire(kind: str, size: float, n: int) -> float:
  """Bytes each device sends for one collective over a group of n (ring algorithms)."""
  return {"all-gather": size * (n - 1) / n, "reduce-scatter": size * (n - 1) / n,
          "all-reduce": 2 * size * (n - 1) / n, "all-to-all": size * (n - 1) / n,
          "collective-permute": size}.get(kind, size)


def _dcn(match, weight, slice_of_device) -> Collective:
  kind = match[2].lower().replace("_", "-")
  size = sum(_array_bytes(match[1]))
  slices = len(set(slice_of_device)) if slice_of_device is not None else 2
  return Collective(kind, weight, size * weight, _wire(kind, size, slices) * weight, True)


def _one(match, line, weight, num_devices, slice_of_device) -> Collective:
  shape, kind, is_async = match[1], match[2], bool(match[3])
  sizes = _array_bytes(shape)
  if is_async and kind in ("all-gather", "collective-permute") and len(sizes) > 1:
    sizes = sizes[len(sizes) // 2:] if kind == "all-gather" else sizes[:1]  # (operands, results)
  size = sum(sizes)
  groups = _groups(line, num_devices)
  n = groups.shape[1]
  if kind == "reduce-scatter":
    size *= n  # what each device contributes
  wire = _wire(kind, size, n)
  dcn = False
  if slice_of_device is not None and groups.max() < len(slice_of_device):
    dcn = bool((np.ptp(np.asarray(slice_of_device)[groups], axis=1) > 0).any())
  return Collective(kind, weight, size * weight, wire * weight, dcn)


def summarize(found: list[Collective]) -> list[dict]:
  """One row per (kind, dcn): count, bytes, wire bytes per device per step."""
  rows = {}
  for c in found:
    row = rows.setdefault((c.kind, c.dcn), {"kind": c.kind, "dcn": c.dcn, "count": 0, "bytes": 0,
                                            "wire_bytes": 0.0})
    row["count"] += c.count
    row["bytes"] += c.bytes
    row["wire_bytes"] += c.wire_bytes
  return sorted(rows.values(), key=lambda r: -r["wire_bytes"])
