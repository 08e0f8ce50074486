"""`mesh.xla_flags`: per-chip presets, explicit lists, and flags a compiler rejects left out
with a note instead of failing the run."""


import jax
import pytest

from jaxpar.cluster import xla_flags
from jaxpar.aot.chips import topology_devices
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config



def test_flags_parse_to_compiler_options():
  assert xla_flags.parse("--xla_tpu_enable_async_collective_fusion=true") == (
      "xla_tpu_enable_async_collective_fusion", True)
  assert xla_flags.parse("xla_tpu_scoped_vmem_limit_kib=98304") == ("xla_tpu_scoped_vmem_limit_kib", 98304)
  assert xla_flags.parse("xla_tpu_aggressive_opt_barrier_removal=ENABLED")[1] == "ENABLED"


def test_a_rejected_flag_is_left_out_and_the_train_step_still_builds():
  config = small_config(mesh={"fsdp": 8, "xla_flags": ["xla_cpu_enable_fast_math=false",
                                                       "xla_no_such_flag=1"]})
  trainer = Trainer(config)
  assert trainer.xla_options == {"xla_cpu_enable_fast_math": False}
  assert len(trainer.xla_notes) == 1 and "xla_no_such_flag=1 left out" in trainer.xla_notes[0]
  assert xla_flags.compiler_options("default", jax.devices()) == ({}, [])  # no CPU preset


@pytest.mark.tpu
@pytest.mark.parametrize("topology, generation", [("v5e-4", "v5e"), ("v6e-4", "v6e"), ("v5p-8", "v5p")])
def test_each_chip_gets_its_preset_minus_what_libtpu_rejects(topology, generation):
  _, devices = topology_devices(topology)
  assert xla_flags.chip_generation(devices[0]) == generation
  options, notes = xla_flags.compiler_options("default", devices)
  preset = dict(xla_flags.parse(f) for f in xla_flags.PRESETS[generation])
  assert options and set(options) <= set(preset)
  assert len(options) + len(notes) == len(preset)  # every flag either applied or explained
  assert xla_flags.compiler_options("none", devices) == ({}, [])
