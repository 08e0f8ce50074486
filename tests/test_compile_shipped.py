"""Every shipped pod config builds its train step for the TPU slice named in its file, one
config per chip generation compiles and fits there at reduced depth (one layer; real widths,
sequence, batch, mesh and remat policy), and each chip's XLA flag preset compiles on the
same slice.

Compiling is what costs, and the flag presets most of all: llama3.1-8b on v6e-256 at one
layer took 334 s alone here with the v6e preset and 77 s without it (each of its flag groups
adds part of that). So the recipes' fits compile with `xla_flags: none`, and each preset
compiles once, over the same whole slice, on the recipe narrowed to a few hundred wide (its
flags, mesh, FSDP over the slice and reduce-scatters are the same; the scheduling passes
they turn on then run on a small program). Lowering, which traces the real step on the
slice's mesh, catches what differs between configs (shapes that do not split, rules,
kernels, remat names) in seconds. Whether the full depth fits is decided by the full compile
in benchmarks/aot_table.py: extrapolating from shallow compiles does not work (llama3-70b on
v6e-256 took 8.17 GiB at 1 layer and 9.34 at 2, which would predict 100 GiB at 80 layers;
the 80-layer compile took 37.3).
"""

import math

import pytest

from jaxpar.aot import hlo
from jaxpar.aot.chips import topology_devices
from jaxpar.aot.compile import abstract_batch, compile_for_topology
from jaxpar.config import load_config, replace
from jaxpar.train.trainer import Trainer

COMPILED = ["llama3.1-8b-v6e-256", "llama2-70b-v5p-512", "qwen2.5-7b",  # v6e, v5p, v5e
            "mixtral-8x7b"]  # expert weights and the MoE dispatch on a v5p-256
# One recipe per chip generation whose XLA flag preset is compiled (narrowed) on its slice.
PRESETS = ["llama3.1-8b-v6e-256", "llama2-70b-v5p-512", "qwen2.5-7b"]  # v6e, v5p, v5e
# FSDP over a whole v6e-256 / v5p-512: without the presets' SparseCore reduce-scatters,
# libtpu lowers these gradient reduce-scatters as all-reduces of the whole gradient.
SLICE_WIDE_FSDP = ("llama3.1-8b-v6e-256", "llama2-70b-v5p-512")
LOWERED = ["llama3.1-70b-v6e-256", "llama3-8b", "llama3-70b", "llama2-70b", "llama2-7b",
           "mistral-7b", "qwen3-30b-a3b", "deepseek-v3-style-16b", "gpt-oss-20b"]


def _one_layer(name):
  """One layer of each kind: dense-first stacks (DeepSeek-style) keep one MoE layer too."""
  config = load_config(name)
  return replace(config, model={"num_layers": config.model.first_dense_layers + 1})


@pytest.mark.pod_fit
@pytest.mark.tpu
@pytest.mark.parametrize("name", COMPILED)
def test_config_compiles_and_fits_on_its_topology_at_one_layer(name):
  config = replace(_one_layer(name), mesh={"xla_flags": "none"})
  report, compiled = compile_for_topology(config, config.mesh.topology)
  assert compiled is not None and report["fits"], report["oom"]
  chips = math.prod(int(n) for n in report["libtpu_topology"].split(":")[1].split("x"))
  assert report["devices"] == chips  # the mesh spans the whole slice
  assert 0 < report["estimate"]["mfu"] < 1
  offloaded = isinstance(config.model.remat, dict) and "offload" in config.model.remat.values()
  assert (report["memory"]["host_total"] > 0) == offloaded


def _narrowed(name):
  """A recipe at one layer, a few heads and a few hundred wide in its MLP and vocabulary: its
  slice, mesh, batch, flag preset and embedding width (FSDP splits that one over the slice;
  libtpu keeps a gradient reduce-scatter only when each device's rows are not too few)."""
  config = _one_layer(name)
  heads = max(config.mesh.tensor, 2)
  return replace(config, model={"num_heads": heads, "num_kv_heads": heads, "head_dim": 128,
                                "mlp_dim": 512, "vocab_size": 1024})


@pytest.mark.pod_fit
@pytest.mark.tpu
@pytest.mark.parametrize("name", PRESETS)
def test_each_chip_flag_preset_compiles_on_the_whole_slice(name):
  config = _narrowed(name)
  report, compiled = compile_for_topology(config, config.mesh.topology)
  assert compiled is not None and report["fits"], report["oom"]
  assert report["xla_flags"]["options"]  # the chip's preset applies
  if name in SLICE_WIDE_FSDP:  # the preset keeps libtpu's reduce-scatters reduce-scatters
    moved = {row["kind"]: row["bytes"] for row in report["collectives"]}
    assert moved.get(hlo.SLICED, 0) < 0.05 * moved["reduce-scatter"], moved


@pytest.mark.tpu
@pytest.mark.parametrize("name", LOWERED)
def test_config_lowers_for_its_topology(name):
  config = _one_layer(name)
  _, devices = topology_devices(config.mesh.topology)
  trainer = Trainer(config, devices)
  with trainer.context():
    lowered = trainer.train_step.lower(trainer.abstract_state(), abstract_batch(trainer))
  assert trainer.mesh.size == len(devices)
  assert f"mhlo.num_partitions = {len(devices)}" in lowered.as_text()
