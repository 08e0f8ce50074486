"""Every shipped pod config builds its train step for the TPU slice named in its file, and
one config per chip generation compiles and fits there at reduced depth (one layer; real
widths, sequence, batch, mesh, remat policy and XLA flag preset).

Compiling is what costs: llama3.1-8b on v6e-256 at one layer took 334 s alone here (12
CPU-minutes; 77 s without the v6e flag preset, whose flag groups each add part of that), the
others 2-4 minutes in the suite. Lowering, which traces the real step on the slice's mesh,
catches what differs between configs (shapes that do not split, rules, kernels, remat names)
in seconds. So four configs compile (one per chip generation, between them every remat kind:
offload, save, full; and Mixtral's expert weights and dispatch), and the rest
lower. Whether the full depth fits is decided by the full compile in benchmarks/aot_table.py:
extrapolating from shallow compiles does not work (llama3-70b on v6e-256 took 8.17 GiB at 1
layer and 9.34 at 2, which would predict 100 GiB at 80 layers; the 80-layer compile took 37.3).
"""

import importlib.util
import math

import pytest

from jaxpar.aot import hlo
from jaxpar.aot.chips import topology_devices
from jaxpar.aot.compile import abstract_batch, compile_for_topology
from jaxpar.config import load_config, replace
from jaxpar.train.trainer import Trainer

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
COMPILED = ["llama3.1-8b-v6e-256", "llama2-70b-v5p-512", "qwen2.5-7b",  # v6e, v5p, v5e
            "mixtral-8x7b"]  # expert weights and the MoE dispatch on a v5p-256
# FSDP over a whole v6e-256 / v5p-512: without the presets' SparseCore reduce-scatters,
# libtpu lowers these gradient reduce-scatters as all-reduces of the whole gradient.
SLICE_WIDE_FSDP = ("llama3.1-8b-v6e-256", "llama2-70b-v5p-512")
LOWERED = ["llama3.1-70b-v6e-256", "llama3-8b", "llama3-70b", "llama2-70b", "llama2-7b",
           "mistral-7b", "qwen3-30b-a3b", "deepseek-v3-style-16b", "gpt-oss-20b"]


def _one_layer(name):
  """One layer of each kind: dense-first stacks (DeepSeek-style) keep one MoE layer too."""
  config = load_config(name)
  return replace(config, model={"num_layers": config.model.first_dense_layers + 1})


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed")
@pytest.mark.parametrize("name", COMPILED)
def test_config_compiles_and_fits_on_its_topology_at_one_layer(name):
  config = _one_layer(name)
  report, compiled = compile_for_topology(config, config.mesh.topology)
  assert compiled is not None and report["fits"], report["oom"]
  chips = math.prod(int(n) for n in report["libtpu_topology"].split(":")[1].split("x"))
  assert report["devices"] == chips  # the mesh spans the whole slice
  assert 0 < report["estimate"]["mfu"] < 1
  assert report["xla_flags"]["options"]  # the chip's preset applies
  offloaded = isinstance(config.model.remat, dict) and "offload" in config.model.remat.values()
  assert (report["memory"]["host_total"] > 0) == offloaded
  if name in SLICE_WIDE_FSDP:  # the preset keeps libtpu's reduce-scatters reduce-scatters
    moved = {row["kind"]: row["bytes"] for row in report["collectives"]}
    assert moved.get(hlo.SLICED, 0) < 0.05 * moved["reduce-scatter"], moved


@pytest.mark.tpu
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed")
@pytest.mark.parametrize("name", LOWERED)
def test_config_lowers_for_its_topology(name):
  config = _one_layer(name)
  _, devices = topology_devices(config.mesh.topology)
  trainer = Trainer(config, devices)
  with trainer.context():
    lowered = trainer.train_step.lower(trainer.abstract_state(), abstract_batch(trainer))
  assert trainer.mesh.size == len(devices)
  assert f"mhlo.num_partitions = {len(devices)}" in lowered.as_text()
