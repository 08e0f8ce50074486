"""Compiled HLO text as data: computations of instructions, the instructions a step executes
(weighted by loop trip counts), and its collectives (kind, bytes per device).

A scanned layer stack compiles to one `while` whose body holds one layer; counting its ops
once (as `cost_analysis()` does) would miss every other layer, so each computation is
weighted by the trip counts of the loops that reach it. Fusion bodies are not executed on
their own: a fusion is one op, and its body says what it computes (roofline.py) and which
collective it implements (TPU reduce-scatters are `all-reduce-scatter` fusions).
"""

import json
import math
import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
                "s4": 0.5, "u4": 0.5}
_HEADER = re.compile(r"^(?:ENTRY )?%(\S+) ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply)=%([\w.\-]+)")


@dataclass
class Instruction:
  name: str
  shape: str  # result shape text, e.g. "bf16[8,128]{1,0}" or a tuple "(f32[], s32[4])"
  op: str
  operands: list[str]  # names of the operand instructions
  args: str  # the operand list as written (a constant's literal)
  attrs: str  # everything after the operand list
  root: bool = False

  @cached_property
  def result_bytes(self) -> float:
    return sum(array_bytes(self.shape))

  def callee(self, kind: str) -> str | None:
    return next((name for k, name in _CALLEE.findall(self.attrs) if k == kind), None)

  @cached_property
  def backend_config(self) -> dict:
    start = self.attrs.find("backend_config={")
    if start < 0:
      return {}
    text, depth = self.attrs[start + len("backend_config="):], 0
    for end, char in enumerate(text):  # the JSON object's own braces
      depth += {"{": 1, "}": -1}.get(char, 0)
      if depth == 0:
        try:
          return json.loads(text[:end + 1])
        except json.JSONDecodeError:
          return {}
    return {}


def array_bytes(shape_text: str) -> list[float]:
  """Bytes of each array in a shape text (one for an array, one per element of a tuple)."""
  return [_DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays(shape_text)]


def arrays(shape_text: str) -> list[tuple[str, list[int]]]:
  """(dtype, dimensions) of each array in a shape text."""
  return [(dtype, [int(d) for d in dims.split(",") if d])
          for dtype, dims, _ in _ARRAY.findall(shape_text) if dtype in _DTYPE_BYTES]


def memory_space_bytes(shape_text: str) -> dict[int, float]:
  """Bytes of the arrays in a shape text by memory space: 0 is HBM (no `S(n)` in the
  layout), 1 on-chip VMEM, 5 pinned host memory, others on-chip scalar memories."""
  spaces = {}
  for dtype, dims, layout in _ARRAY.findall(shape_text):
    if dtype in _DTYPE_BYTES:
      space = int(m[1]) if (m := re.search(r"S\((\d+)\)", layout)) else 0
      size = _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
      spaces[space] = spaces.get(space, 0) + size
  return spaces


class Module:
  """Parsed HLO text: `computations[name]` is its instructions in order; `shapes[name]` maps
  instruction names (unique within a module) to their result shape text."""

  def __init__(self, text: str):
    self.computations: dict[str, list[Instruction]] = {}
    self.entry = None
    current = None
    for line in text.splitlines():
      if m := _HEADER.match(line):
        current = self.computations.setdefault(m[1], [])
        if line.startswith("ENTRY"):
          self.entry = m[1]
      elif current is not None and (m := _INSTRUCTION.match(line)):
        args, _, attrs = m[4].partition(")")
        current.append(Instruction(m[1], m[2], m[3], re.findall(r"%([\w.\-]+)", args), args,
                                   attrs, root=line.lstrip().startswith("ROOT")))
    self.instructions = {i.name: i for body in self.computations.values() for i in body}
    self.shapes = {name: i.shape for name, i in self.instructions.items()}
    self.users: dict[str, list[tuple[Instruction, int]]] = {}
    for body in self.computations.values():
      for inst in body:
        for index, operand in enumerate(inst.operands):
          self.users.setdefault(operand, []).append((inst, index))

  def trip_count(self, loop: Instruction) -> int:
    """A while loop's trip count: XLA's `known_trip_count`, else the scan's condition
    `compare(counter, N), direction=LT`; 1 when neither says (better to undercount)."""
    known = loop.backend_config.get("known_trip_count", {}).get("n")
    if known is not None:
      return int(known)
    condition = self.computations.get(loop.callee("condition"), [])
    constants = {i.name: int(i.args) for i in condition if i.op == "constant" and i.args.isdigit()}
    root = next((i for i in condition if i.root), None)
    if root is None or root.op != "compare" or "direction=LT" not in root.attrs:
      return 1
    return next((constants[o] for o in root.operands if o in constants), 1)

  def executed(self):
    """(instruction, times per step) for every op the step runs: the entry computation,
    loop bodies x trip counts, called and branch computations; not fusion bodies."""
    def visit(name, weight):
      for inst in self.computations.get(name, ()):
        yield inst, weight
        if inst.op == "while":
          yield from visit(inst.callee("body"), weight * self.trip_count(inst))
        elif inst.op == "call":
          yield from visit(inst.callee("to_apply") or inst.callee("calls"), weight)
        elif inst.op == "conditional":
          branches = inst.attrs.split("branch_computations={", 1)[-1].split("}", 1)[0]
          for branch in re.findall(r"%([\w.\-]+)", branches):
            yield from visit(branch, weight)
    yield from visit(self.entry, 1)

  def fused(self, fusion: Instruction) -> list[Instruction]:
    return self.computations.get(fusion.callee("calls"), [])

  def kept_fraction(self, name: str) -> float:
    """The largest fraction of value `name` any of its uses reads: 1 if one reads it all,
    less when every use is a dynamic-slice of it (directly or inside a fusion)."""
    fraction = 0.0
    for user, index in self.users.get(name, ()):
      if user.op == "dynamic-slice" and index == 0:
        part = user.result_bytes
      elif user.op == "fusion":
        param = next((i for i in self.fused(user) if i.op == "parameter" and i.args == str(index)), None)
        inner = self.users.get(param.name, []) if param else []
        if not inner or any(u.op != "dynamic-slice" or k != 0 for u, k in inner):
          return 1.0
        part = max(u.result_bytes for u, _ in inner)
      else:
        return 1.0
      fraction = max(fraction, part / max(sum(array_bytes(self.shapes[name])), 1))
    return fraction or 1.0


@dataclass
class Collective:
  kind: str
  count: int  # executions per step (loop trips included)
  bytes: float  # result bytes per device per step (for reduce-scatter: its input)
  wire_bytes: float  # bytes each device sends per step (ring algorithms)
  dcn: bool  # its groups span slices
  dtype: str = ""


def collectives(hlo: str | Module, slice_of_device=None, *, cpu: bool = False) -> list[Collective]:
  """Every collective op of the compiled module, weighted by loop trips.

  slice_of_device: slice index per flat mesh device (multi-slice), to flag DCN collectives.
  An all-reduce whose every use keeps only this device's 1/n slice is what the partitioner
  writes for a reduce-scatter; one whose input is this device's 1/n written into zeros, an
  all-gather. On a TPU these are real all-reduces on the wire, counted as such under the
  kinds "all-reduce (sliced)" and "all-reduce (gather)": libtpu emits a reduce-scatter whose
  group spans more than one torus dimension that way (even an explicit `psum_scatter`;
  unless the SparseCores run it, see xla_flags.py), and on v5p many gathers. cpu: the module
  was compiled for (simulated) CPU devices, a backend with no reduce-scatter creator; there
  a sliced all-reduce is counted as the reduce-scatter it stands for.
  """
  module = hlo if isinstance(hlo, Module) else Module(hlo)
  num_devices = len(slice_of_device) if slice_of_device is not None else 1
  found = []
  for inst, weight in module.executed():
    if inst.op == "fusion" and _continues_async_chain(module, inst):
      continue
    for c in collective(module, inst, num_devices, slice_of_device, cpu=cpu):
      found.append(Collective(c.kind, weight, c.bytes * weight, c.wire_bytes * weight, c.dcn,
                              c.dtype))
  return found


def axis_coordinates(mesh, axis: str) -> list[int]:
  """Each flat mesh device's index along `axis`. Passed as `collectives`' slice_of_device,
  it flags (`dcn`) exactly the collectives whose groups cross that axis."""
  position = mesh.axis_names.index(axis)
  return [int(np.unravel_index(i, mesh.devices.shape)[position]) for i in range(mesh.size)]


def _continues_async_chain(module, fusion) -> bool:
  """Whether a fusion is a later step of an asynchronous collective (libtpu splits one into
  a start, continuation steps, possibly inside another loop, and a done fusion): those take
  the chain's semaphores (s32/u32 in scalar memories S(2), S(4)); the start takes only data."""
  return any(re.search(r"\b[su]32\[[0-9,]*\]\{[^}]*S\([24]\)", module.shapes.get(o, ""))
             for o in fusion.operands)


def collective(module, inst, num_devices, slice_of_device=None, *, cpu=False) -> list[Collective]:
  """The collectives one executed op performs (once): none, one, or on CPU for a combined
  all-reduce one per part (see `collectives`)."""
  kind = inst.op.removesuffix("-start")
  if kind == "all-reduce":
    return _all_reduce_parts(module, inst, _groups(inst.attrs, num_devices), slice_of_device, cpu)
  if kind in KINDS:
    sizes = array_bytes(inst.shape)
    if inst.op.endswith("-start") and kind in ("all-gather", "collective-permute") and len(sizes) > 1:
      sizes = sizes[len(sizes) // 2:] if kind == "all-gather" else sizes[:1]  # (operands, results)
    return [_sized(kind, sum(sizes), _groups(inst.attrs, num_devices), slice_of_device,
                   _dtype(inst.shape))]
  if inst.op == "send" and (m := re.search(r"_xla_megascale_transfer_type=\"(\w+)\"", inst.attrs)):
    kind = m[1].lower().replace("_", "-")
    size = sum(array_bytes(inst.shape)[:-1])  # (data..., u32[], token[])
    slices = len(set(slice_of_device)) if slice_of_device is not None else 2
    if kind == "all-gather":  # a row counts the gathered result: the matching recv's, when it is larger
      size = max(size, _received_bytes(module, inst))
    return [Collective(kind, 1, size, _wire(kind, size, slices), True, _dtype(inst.shape))]
  if inst.op == "fusion":
    emitter = inst.backend_config.get("collective_algorithm_config", {}).get("emitter", "")
    inner = next((i for i in module.fused(inst) if i.op.removesuffix("-start") in KINDS), None)
    if inner is None:
      return []
    kind = "reduce-scatter" if "ReduceScatter" in emitter else inner.op.removesuffix("-start")
    # An all-reduce-scatter fusion all-reduces its input and keeps this device's slice:
    # a reduce-scatter of the input (the size a reduce-scatter row counts).
    size = sum(sum(array_bytes(module.shapes[o])) for o in inner.operands) \
        if kind == "reduce-scatter" else sum(array_bytes(inner.shape))
    groups = _groups(inner.attrs, num_devices)
    return [_sized(kind, size, groups, slice_of_device, _dtype(inner.shape), input_size=True)]
  return []


def _received_bytes(module, send) -> float:
  """Data bytes of the recv that pairs with a cross-slice send (same rendezvous), else 0: a
  gather's send may carry this slice's part alone, its recv always the whole result."""
  key = re.search(r'_xla_host_transfer_rendezvous="([^"]+)"', send.attrs)
  if key is None:
    return 0.0
  recv = next((i for i in module.instructions.values() if i.op == "recv" and key[0] in i.attrs), None)
  return sum(array_bytes(recv.shape)[:-1]) if recv is not None else 0.0


SLICED = "all-reduce (sliced)"
GATHER = "all-reduce (gather)"


def _all_reduce_parts(module, inst, groups, slice_of_device, cpu) -> list[Collective]:
  """An all-reduce, split by what its users keep: a part of which every use reads only
  this device's 1/n slice stands for a reduce-scatter (see `collectives`)."""
  n = groups.shape[1]
  sizes = array_bytes(inst.shape)
  if len(sizes) == 1:
    parts = [(inst.name, sizes[0])]
  else:  # a combined all-reduce: its parts are read through get-tuple-element
    gtes = {int(re.search(r"index=(\d+)", u.attrs)[1]): u.name
            for u, _ in module.users.get(inst.name, ()) if u.op == "get-tuple-element"}
    parts = [(gtes.get(i), size) for i, size in enumerate(sizes)]
  totals = {}
  for index, (name, size) in enumerate(parts):
    scattered = n > 1 and name is not None and module.kept_fraction(name) * n <= 1 + 1e-9
    kind = ("reduce-scatter" if cpu else SLICED) if scattered else "all-reduce"
    if kind == "all-reduce" and n > 1 and _written_into_zeros(module, inst.operands[index]) * n == size:
      kind = GATHER
    totals[kind] = totals.get(kind, 0) + size
  return [_sized(kind, size, groups, slice_of_device, _dtype(inst.shape), input_size=True)
          for kind, size in totals.items()]


def _dtype(shape: str) -> str:
  found = arrays(shape)
  return found[0][0] if found else ""


def _written_into_zeros(module, name) -> float:
  """Bytes of the piece `name` writes with dynamic-update-slice into an otherwise untouched
  buffer (this device's shard, before an all-reduce gathers it), else 0."""
  producer = module.instructions.get(name)
  if producer is not None and producer.op == "fusion":
    producer = next((i for i in module.fused(producer) if i.root), None)
  if producer is None or producer.op != "dynamic-update-slice":
    return 0.0
  return sum(array_bytes(module.shapes[producer.operands[1]]))


def _sized(kind, size, groups, slice_of_device, dtype, input_size=False) -> Collective:
  n = groups.shape[1]
  if kind == "reduce-scatter" and not input_size:
    size *= n  # the op's result is 1/n of what each device contributes
  dcn = False
  if slice_of_device is not None and groups.max() < len(slice_of_device):
    dcn = bool((np.ptp(np.asarray(slice_of_device)[groups], axis=1) > 0).any())
  wire = _wire("all-reduce" if kind in (SLICED, GATHER) else kind, size, n)
  return Collective(kind, 1, size, wire, dcn, dtype)


def _groups(attrs: str, num_devices: int) -> np.ndarray:
  """Replica groups as [num_groups, group_size] device indices (into the mesh's flat devices)."""
  if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\S+)? \{([^}]*)\}", attrs):
    axes = re.findall(r"'(\w+)'=(\d+)", m[1])
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    reduced = [names.index(a) for a in re.findall(r"'(\w+)'", m[2])]
    ids = _device_ids(attrs, math.prod(sizes)).reshape(sizes)
    kept = [i for i in range(len(sizes)) if i not in reduced]
    return ids.transpose(kept + reduced).reshape(-1, math.prod(sizes[i] for i in reduced))
  if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
    shape = [int(d) for d in m[3].split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    if m[4]:
      ids = ids.transpose([int(d) for d in m[4].split(",")])
    return ids.reshape(int(m[1]), int(m[2]))
  if m := re.search(r"replica_groups=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", attrs):
    return np.array([[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", m[1])])
  if "source_target_pairs=" in attrs:
    pairs = re.findall(r"\{(\d+),(\d+)\}", attrs.split("source_target_pairs=")[1])
    return np.array([[int(a), int(b)] for a, b in pairs])
  return np.arange(num_devices)[None]


def _device_ids(attrs: str, count: int) -> np.ndarray:
  """The devices a mesh-style replica group numbers in order: `device_ids=([4,2]T(1,0))`
  (an iota, reshaped and transposed), an explicit list, or none (0..count-1)."""
  if m := re.search(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)", attrs):
    ids = np.arange(count).reshape([int(d) for d in m[1].split(",")])
    return (ids.transpose([int(d) for d in m[2].split(",")]) if m[2] else ids).reshape(-1)
  if m := re.search(r"device_ids=\{([\d,]+)\}", attrs):
    return np.array([int(d) for d in m[1].split(",")])
  return np.arange(count)


def _wire(kind: str, size: float, n: int) -> float:
  """Bytes each device sends for one collective over a group of n (ring algorithms)."""
  return {"all-gather": size * (n - 1) / n, "reduce-scatter": size * (n - 1) / n,
          "all-reduce": 2 * size * (n - 1) / n, "all-to-all": size * (n - 1) / n,
          "collective-permute": size}.get(kind, size)


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


def operand_types(module: Module, op: Instruction) -> tuple[str, str]:
  """The element types of a matmul's two operands ("s8", "bf16", ...)."""
  return tuple(_dtype(module.shapes.get(name, "")) for name in op.operands[:2])


def matmul_types(module: Module) -> dict[str, int]:
  """The matmuls a step runs (dots, and the convolutions TPUs write them as; inside fusions
  too; loop trips counted), by operand types: {"bf16 x bf16": 960, "s8 x s8": 2880, ...}.
  What shows whether model.train_precision's narrow operands reach the matrix units."""
  counts: dict[str, int] = {}
  for inst, times in module.executed():
    inside = module.fused(inst) if inst.op == "fusion" else [inst]
    for op in inside:
      if op.op in ("dot", "convolution") and len(op.operands) >= 2:
        key = " x ".join(operand_types(module, op))
        counts[key] = counts.get(key, 0) + times
  return dict(sorted(counts.items(), key=lambda item: -item[1]))
