"""One line of `jaxpar check`'s table: what ran, how far from its reference, how fast."""

import dataclasses
import json

import jax
import numpy as np


@dataclasses.dataclass
class Result:
  name: str  # what ran, e.g. "flash attention fwd+bwd"
  shape: str
  status: str = "PASS"  # PASS | FAIL | SKIP (nothing to run here, e.g. collectives on one device)
  error: float | None = None  # relative L2 error against the reference
  tolerance: float | None = None
  seconds: float | None = None  # median time of one call
  work: float | None = None  # FLOPs or bytes one call does
  unit: str = "FLOP"  # FLOP | B
  peak: float | None = None  # the rate `work / seconds` is set against, per second
  peak_source: str = ""
  note: str = ""

  @property
  def rate(self) -> float | None:
    return self.work / self.seconds if self.work and self.seconds else None

  @property
  def of_peak(self) -> float | None:
    return self.rate / self.peak if self.rate and self.peak else None

  def as_dict(self) -> dict:
    return {**dataclasses.asdict(self), "rate": self.rate, "of_peak": self.of_peak}


def relative_error(out, ref) -> float:
  """max over the leaves of ||out - ref|| / ||ref||, in float64 on the host."""
  worst = 0.0
  for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
    o, r = np.asarray(o, np.float64), np.asarray(r, np.float64)
    if o.shape != r.shape:
      raise ValueError(f"output shape {o.shape} differs from the reference's {r.shape}")
    if not np.all(np.isfinite(o)):
      return float("nan")
    worst = max(worst, float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)))
  return worst


def failed(name: str, shape: str, error: BaseException) -> Result:
  """A case that raised: its first line says what broke."""
  text = str(error).strip().splitlines()
  return Result(name, shape, status="FAIL", note=f"{type(error).__name__}: {text[0] if text else ''}"[:200])


def _si(value: float | None, unit: str) -> str:
  if value is None:
    return "-"
  for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(value) >= factor:
      return f"{value / factor:.1f} {prefix}{unit}"
  return f"{value:.1f} {unit}"


def table_rows(results: list[Result]) -> list[tuple[str, ...]]:
  """(status, name, shape, error / tolerance, time, rate, of peak, note) per result, as text."""
  rows = []
  for r in results:
    error = "-" if r.error is None else f"{r.error:.1e} / {r.tolerance:.0e}"
    seconds = "-" if r.seconds is None else f"{r.seconds * 1e3:.3f} ms"
    of_peak = "-" if r.of_peak is None else f"{100 * r.of_peak:.1f}%"
    rows.append((r.status, r.name, r.shape, error, seconds, _si(r.rate, r.unit + "/s"), of_peak, r.note))
  return rows


def write_json(path, header: dict, results: list[Result]):
  with open(path, "w") as f:
    json.dump({**header, "results": [r.as_dict() for r in results],
               "passed": not any(r.status == "FAIL" for r in results)}, f, indent=1, default=str)
