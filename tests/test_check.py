"""`jaxpar check --quick` on CPU: every kernel family against its reference, a train step, a
decode step and the collectives over the 8 simulated devices; a broken kernel fails it."""

import json

import jax.numpy as jnp

from jaxpar.cli import main
from jaxpar.pallas_kernels.attention import dispatch

FAMILIES = ("flash attention fwd", "flash attention fwd+bwd", "paged decode attention (cpu)",
            "paged decode attention (interpreted)", "quantized matmul int8", "quantized matmul int4",
            "quantized matmul w8a8", "grouped MoE SwiGLU", "gated delta rule fwd", "gated delta rule fwd+bwd",
            "ring attention", "train step (MFU)", "decode step",
            "all-reduce", "all-gather")


def test_check_quick_passes_on_cpu_and_writes_json(tmp_path, capsys):
  out = tmp_path / "check.json"
  assert main(["check", "--quick", "--output", str(out)]) == 0
  report = json.loads(out.read_text())
  assert report["passed"] and report["backend"] == "cpu" and report["local_devices"] == 8
  results = {r["name"].replace(" (interpreted)", "", 1) if "decode" not in r["name"] else r["name"]: r
             for r in report["results"]}
  assert set(results) == set(FAMILIES)
  for name, r in results.items():
    assert r["status"] == "PASS", (name, r)
    assert r["seconds"] > 0 and r["rate"] > 0, name  # everything ran and was timed here
    if r["error"] is not None:
      assert r["error"] <= r["tolerance"], name
  kernels = [r for r in report["results"] if r["error"] is not None]
  assert len(kernels) == 11  # every kernel compared with its reference, ring attention included
  assert "PASS: 15 checks" in capsys.readouterr().out


def test_check_fails_naming_a_broken_kernel(monkeypatch, capsys):
  """A flash kernel 1% off its reference fails the check with exit 1 and names it."""
  kernel = dispatch.flash_attention_tpu
  monkeypatch.setattr(dispatch, "flash_attention_tpu", lambda *a, **kw: kernel(*a, **kw) * jnp.float32(1.01))
  assert main(["check", "--quick", "--only", "kernels"]) == 1
  out = capsys.readouterr().out
  assert "FAIL: 2 of 11 checks: flash attention fwd (interpreted)" in out
  assert "flash attention fwd+bwd (interpreted)" in out.splitlines()[-1]


def test_check_times_the_natively_multiplied_train_precisions(monkeypatch, tmp_path):
  """Where the device multiplies int8 natively (NVIDIA, TPU v5/v6; stood in for here), the
  train step runs again with int8 matmuls, must learn too, and is set beside the plain one."""
  from jaxpar.check import steps
  monkeypatch.setattr(steps, "native", lambda scheme, device: scheme == "int8")
  out = tmp_path / "check.json"
  assert main(["check", "--quick", "--only", "steps", "--output", str(out)]) == 0
  results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
  assert set(results) == {"train step (MFU)", "train step, int8 matmuls (MFU)", "decode step"}
  narrow = results["train step, int8 matmuls (MFU)"]
  assert narrow["status"] == "PASS" and "x the plain step's speed" in narrow["note"]
