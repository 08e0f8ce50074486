"""Every shipped pod config compiles for the TPU slice named in its file and fits there at
reduced depth (one layer; real widths, sequence, batch and mesh).

Whether the full depth fits is decided by the full compile in benchmarks/aot_table.py
(1-3 CPU-minutes each here). Extrapolating from shallow compiles does not work: llama3-70b on
v6e-256 takes 8.17 GiB at 1 layer and 9.34 at 2, which would predict 100 GiB at 80 layers;
the 80-layer compile takes 37.3.
"""

import importlib.util
import math

import pytest

from jaxpar.aot.compile import compile_for_topology
from jaxpar.config import load_config, replace

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
POD_CONFIGS = ["llama3-8b", "llama3-70b", "llama2-70b", "llama2-7b", "mistral-7b", "qwen2.5-7b"]


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed")
@pytest.mark.parametrize("name", POD_CONFIGS)
def test_shipped_config_compiles_and_fits_on_its_topology_at_one_layer(name):
  config = load_config(name)
  report, compiled = compile_for_topology(replace(config, model={"num_layers": 1}),
                                          config.mesh.topology)
  assert compiled is not None and report["fits"], report["oom"]
  chips = math.prod(int(n) for n in report["libtpu_topology"].split(":")[1].split("x"))
  assert report["devices"] == chips  # the mesh spans the whole slice
  assert 0 < report["estimate"]["mfu"] < 1
