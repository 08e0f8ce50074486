"""Our step-time estimate for a compiled train step on a TPU slice, built from the compiled
program itself (one device's partitioned HLO), not from the model's formula.

Method. Every op the step executes is visited once per execution (hlo.Module.executed:
loop bodies times their trip counts), and costed:

  FLOPs   matmuls only: a dot or convolution does 2 x (result elements) x (contracted
          elements per result), found inside fusions too; a Pallas kernel (Mosaic custom
          call) counts the `pl.CostEstimate` it carries. Elementwise work is left to the
          bytes term (on a TPU it is memory-bound).
  bytes   what the op reads and writes in HBM: its operands and its result. An operand the
          op only slices (dynamic-slice inside a fusion: one layer of a stacked weight)
          counts the slice; a dynamic-update-slice writes in place (counts the update).
          A Pallas kernel counts its estimate's bytes_accessed.
  time    per op, max(FLOPs / peak, bytes / HBM bandwidth): each op at its own
          roofline, ops in sequence; the peak is the chip's int8 one for a dot of two s8
          operands (train_precision int8, an int8 matmul), bf16 for any other. Collectives: per-device bytes on the wire (ring
          algorithms, hlo.py) over the chip's ICI bandwidth, DCN ones over DCN bandwidth.
  host    bytes copied between HBM and host memory (remat offload): reported, not timed
          (no published per-chip host link bandwidth; the copies are asynchronous).

  step       = ops + ICI + DCN        (nothing overlaps: pessimistic)
  overlapped = max(ops, ICI + DCN)   (every collective hidden behind compute: optimistic)
  MFU        = model FLOPs / (step x devices x peak); model FLOPs are the formula's
               (6 x params x tokens + attention), so remat recompute lowers MFU; the
               compiled FLOPs (with recompute) are reported beside them.

Optimistic where kernels run below their roofline (MXU utilisation, VMEM spills, pipeline
bubbles); pessimistic where XLA overlaps collectives and copies with compute. An estimate,
never a measurement. The compiler's own `cost_analysis()` is not used: it counts one trip
of a loop, a Pallas kernel without an estimate as zero, and its `optimal_seconds` is
negative on some programs (each ConcatBitcast adds -1 s).
"""

import math
import re
from dataclasses import dataclass

from jaxpar.aot import hlo

# Ops that move no data of their own (or whose cost is counted elsewhere).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
         "conditional", "after-all", "partition-id", "replica-id", "opt-barrier", "iota",
         "add-dependency", "send", "send-done", "recv", "recv-done", "copy-start", "copy-done"}
_FREE_CALLS = ("AllocateBuffer", "AssumeGatherIndicesInBound", "ConcatBitcast")
_ASYNC_COLLECTIVE = ("AsyncCollectiveStart", "AsyncCollectiveDone")
_HOST = 5  # XLA's memory space of pinned host memory in TPU layouts (`S(5)`)


@dataclass
class Cost:
  flops: float = 0.0  # per device per step: matmuls and Pallas kernels
  bytes: float = 0.0  # HBM bytes read and written
  ops_s: float = 0.0  # sum over ops of each op's roofline time
  host_bytes: float = 0.0  # copied between HBM and host memory


@dataclass
class Estimate:
  ops_s: float
  ici_s: float
  dcn_s: float
  flops: float
  bytes: float
  host_bytes: float

  @property
  def step_s(self) -> float:
    return self.ops_s + self.ici_s + self.dcn_s

  @property
  def overlapped_s(self) -> float:
    return max(self.ops_s, self.ici_s + self.dcn_s)


def estimate(chip, module: hlo.Module, collective_rows) -> Estimate:
  cost = program_cost(module, chip.peak_flops, chip.hbm_bandwidth, chip.int8_flops)
  ici = sum(r["wire_bytes"] for r in collective_rows if not r["dcn"]) / chip.ici_bandwidth
  dcn = sum(r["wire_bytes"] for r in collective_rows if r["dcn"]) / chip.dcn_bandwidth
  return Estimate(cost.ops_s, ici, dcn, cost.flops, cost.bytes, cost.host_bytes)


def program_cost(module: hlo.Module, peak_flops: float, hbm_bandwidth: float,
                 int8_flops: float | None = None) -> Cost:
  total = Cost()
  for inst, times in module.executed():
    total.host_bytes += times * host_transfer_bytes(inst)
    flops, int8, nbytes = op_cost(module, inst)
    total.flops += times * flops
    total.bytes += times * nbytes
    compute_s = (flops - int8) / peak_flops + int8 / (int8_flops or peak_flops)
    total.ops_s += times * max(compute_s, nbytes / hbm_bandwidth)
  return total


def host_transfer_bytes(inst: hlo.Instruction) -> float:
  """Bytes an asynchronous copy moves between HBM and host memory (remat offload): a whole
  array (copy), or one layer's slice written to / read from a host buffer stacked over layers."""
  if f"S({_HOST})" not in inst.shape or not inst.op.endswith("-start"):
    return 0.0
  if inst.op == "copy-start":  # (destination, source, context): a scalar (a step count) too
    return hlo.array_bytes(inst.shape)[0]
  sizes = [size for size in hlo.array_bytes(inst.shape) if size > 4]  # not indices, context
  if inst.op == "dynamic-update-slice-start":  # ((buffer, update, indices...), result, context)
    return sizes[1]
  if inst.op == "dynamic-slice-start":  # ((buffer, indices...), slice, context)
    return sizes[1]
  return 0.0


def op_cost(module: hlo.Module, inst: hlo.Instruction) -> tuple[float, float, float]:
  """(FLOPs, those of them in int8 dots, HBM bytes) of one execution of a top-level op."""
  if inst.op in _FREE or inst.op.endswith("-done") or inst.op.removesuffix("-start") in hlo.KINDS:
    return 0.0, 0.0, 0.0
  if inst.op == "fusion" and any(f'"{name}"' in i.attrs for i in module.fused(inst)
                                 for name in _ASYNC_COLLECTIVE):
    return 0.0, 0.0, 0.0  # the start or end of an asynchronous collective: costed as communication
  if inst.op == "custom-call":
    if any(f'"{name}"' in inst.attrs for name in _FREE_CALLS):
      return 0.0, 0.0, 0.0
    if estimate := inst.backend_config.get("custom_call_config", {}).get("cost_estimate") \
        or inst.backend_config.get("cost_estimate"):
      return float(estimate.get("flops", 0)), 0.0, float(estimate.get("bytes_accessed", 0))
  body = module.fused(inst) if inst.op == "fusion" else [inst]
  ops = list(_fused_ops(module, body))
  flops = sum(matmul_flops(module, i) for i in ops)
  int8 = sum(matmul_flops(module, i) for i in ops if _int8_dot(module, i))
  return flops, int8, _hbm_bytes(module, inst)


def _int8_dot(module: hlo.Module, inst: hlo.Instruction) -> bool:
  """A matmul (dot, or the convolution TPU HLO writes one as) of two s8 operands: the MXU
  runs it at the chip's int8 rate."""
  return inst.op in ("dot", "convolution") and hlo.operand_types(module, inst) == ("s8", "s8")


def _fused_ops(module, body):
  for inst in body:
    yield inst
    if inst.op == "fusion":
      yield from _fused_ops(module, module.fused(inst))


def matmul_flops(module: hlo.Module, inst: hlo.Instruction) -> float:
  """2 x result elements x contracted elements per result element, for dot/convolution."""
  if inst.op == "dot":
    lhs = hlo.arrays(module.shapes[inst.operands[0]])[0][1]
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    per_result = math.prod(lhs[int(d)] for d in contracting[1].split(",") if d) if contracting else 1
    return 2.0 * _elements(inst.shape) * per_result
  if inst.op == "convolution":
    return 2.0 * _convolution_macs(module, inst)
  return 0.0


def _convolution_macs(module, conv) -> float:
  """TPU HLO writes matmuls as convolutions, some with a head axis as a padded window
  (`size=1x32 pad=0_0x31_31`): only the taps that land on real input multiply anything,
  so each spatial dim contributes its count of (output, tap) pairs inside the input."""
  lhs_labels, kernel_labels, out_labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", conv.attrs).groups()
  lhs = hlo.arrays(module.shapes[conv.operands[0]])[0][1]
  kernel = hlo.arrays(module.shapes[conv.operands[1]])[0][1]
  out = hlo.arrays(conv.shape)[0][1]
  window = re.search(r"window=\{([^}]*)\}", conv.attrs)
  fields = dict(f.split("=", 1) for f in window[1].split()) if window else {}
  spatial = [c for c in out_labels if c.isdigit()]
  sizes = [int(k) for k in fields["size"].split("x")] if "size" in fields else [1] * len(spatial)
  pads = [tuple(int(p) for p in pair.split("_")) for pair in fields["pad"].split("x")] \
      if "pad" in fields else [(0, 0)] * len(spatial)
  strides = [int(v) for v in fields["stride"].split("x")] if "stride" in fields else [1] * len(spatial)
  per_output_row = math.prod(out) / math.prod(out[out_labels.index(d)] for d in spatial)
  pairs = 1
  for d, (taps, (low, _), stride) in enumerate(zip(sizes, pads, strides)):
    size_in, size_out = lhs[lhs_labels.index(str(d))], out[out_labels.index(str(d))]
    pairs *= sum(max(0, min(size_out, -(-(size_in + low - k) // stride)) - max(0, -(-(low - k) // stride)))
                 for k in range(taps))
  return per_output_row * pairs * kernel[kernel_labels.index("i")]


def _elements(shape: str) -> int:
  return sum(math.prod(d) for _, d in hlo.arrays(shape))


def _hbm(shape: str) -> float:
  return hlo.memory_space_bytes(shape).get(0, 0.0)


def _hbm_bytes(module, inst) -> float:
  """HBM bytes an op reads and writes: its operands and result that live in HBM (not in
  VMEM or scalar memory); of an operand it only slices, the slice; of a result it writes
  in place with dynamic-update-slice or scatter (a KV cache's new tokens), the update."""
  if inst.op == "fusion":
    body = module.fused(inst)
    params = {int(i.args): i for i in body if i.op == "parameter"}
    root = next((i for i in body if i.root), None)
  else:  # a lone op reads its operands the way a fusion of just that op would
    params, root = {}, inst
  outputs = [root] if root is None or root.op != "tuple" else \
      [next(i for i in body if i.name == o) for o in root.operands]
  written, in_place = 0.0, set()
  for out in (o for o in outputs if o is not None):
    if out.op in ("dynamic-update-slice", "scatter"):  # written in place: the update's bytes
      in_place.add(out.operands[0])
      update = sum(hlo.array_bytes(module.shapes[out.operands[1 if out.op == "dynamic-update-slice" else -1]]))
      written += update * _hbm(out.shape) / max(out.result_bytes, 1)
    else:
      written += _hbm(out.shape)
  read = 0.0
  for index, operand in enumerate(inst.operands):
    param = params.get(index) if inst.op == "fusion" else None
    name = param.name if param is not None else None
    if inst.op != "fusion":
      if operand in in_place:
        continue
      fraction = _sliced_fraction_of_op(inst, index, module)
    elif name in in_place:
      continue
    else:
      fraction = _read_fraction(module, name) if name else 1.0
    read += fraction * _hbm(module.shapes.get(operand, ""))
  return read + written


_SLICES = ("dynamic-slice", "slice", "gather")


def _sliced_fraction_of_op(inst, index, module) -> float:
  if inst.op in _SLICES and index == 0:
    return inst.result_bytes / max(sum(hlo.array_bytes(module.shapes[inst.operands[0]])), 1)
  return 1.0


def _read_fraction(module, name: str) -> float:
  """The fraction of a fusion parameter its body reads: less than 1 only when every use
  slices it (directly, through a bitcast, or inside a nested fusion)."""
  full = max(sum(hlo.array_bytes(module.shapes[name])), 1)
  read = 0.0
  for user, index in module.users.get(name, ()):
    if user.op in _SLICES and index == 0:
      read += user.result_bytes / full
    elif user.op == "bitcast":
      read += _read_fraction(module, user.name)
    elif user.op == "fusion":
      inner = next((i for i in module.fused(user) if i.op == "parameter" and i.args == str(index)), None)
      read += _read_fraction(module, inner.name) if inner else 1.0
    else:
      return 1.0
  return min(read, 1.0)
