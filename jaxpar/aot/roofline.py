"""Our step-time estimate for a compiled train step on a TPU slice. An estimate, not a
measurement; the compiler's own `optimal_seconds` is unreliable (negative on some
programs, one loop trip only), so we add up three roofline terms:

  compute = model FLOPs x remat factor / (devices x chip bf16 peak)
            full remat runs the forward twice: 8 forward-passes' worth instead of 6 (x 4/3);
            save_dots recomputes only elementwise ops (x 1).
  comm    = per-device bytes on the wire of every collective in the compiled HLO (ring
            algorithms, loop trips counted) / per-chip ICI bandwidth; DCN ones / DCN bandwidth.
  memory  = 2 x per-device argument bytes / HBM bandwidth: the optimizer reads and writes
            the whole train state once per step.

  step = compute + comm + memory

Errors go both ways: matmuls at 100% of peak and no attention/elementwise/HBM cost make it
optimistic; no overlap of collectives with compute (XLA's async collectives do overlap
FSDP gathers) makes it pessimistic. `overlapped_s` = max(compute, comm) + memory is the
bound if every collective hid behind compute.
"""

from dataclasses import dataclass

REMAT_FACTOR = {"none": 1.0, "save_dots": 1.0, "save_dots_no_batch": 1.0, "full": 4 / 3}


@dataclass
class Estimate:
  compute_s: float
  ici_s: float
  dcn_s: float
  memory_s: float

  @property
  def step_s(self) -> float:
    return self.compute_s + self.ici_s + self.dcn_s + self.memory_s

  @property
  def overlapped_s(self) -> float:
    return max(self.compute_s, self.ici_s + self.dcn_s) + self.memory_s


def estimate(chip, num_devices: int, model_flops: float, remat: str, collective_rows,
             argument_bytes: float) -> Estimate:
  compute = model_flops * REMAT_FACTOR[remat] / (num_devices * chip.peak_flops)
  ici = sum(r["wire_bytes"] for r in collective_rows if not r["dcn"]) / chip.ici_bandwidth
  dcn = sum(r["wire_bytes"] for r in collective_rows if r["dcn"]) / chip.dcn_bandwidth
  return Estimate(compute, ici, dcn, 2 * argument_bytes / chip.hbm_bandwidth)
