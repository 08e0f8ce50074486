"""The parallel plan: one object says what each mesh axis does and holds every axis check;
configs written before the `parallel` section keep working."""

import logging

import jax
import pytest

from jaxpar.aot import plan as planner
from jaxpar.config import load_config
from jaxpar.errors import ConfigError
from jaxpar.inference import Engine
from jaxpar.parallel import ParallelConfig, migrate_model_keys
from jaxpar.runtime import Runtime
from tests.helpers import small_config


def test_old_model_keys_move_to_the_parallel_section_with_one_note_each(caplog):
  tree = {"model": {"context_parallel": "ring", "context_load_balance": False, "sequence_parallel": True}}
  with caplog.at_level(logging.WARNING, logger="jaxpar.parallel"):
    migrated = migrate_model_keys(tree)
  assert migrated["model"] == {} and tree["model"]["context_parallel"] == "ring"  # input untouched
  assert ParallelConfig.model_validate(migrated["parallel"]) == ParallelConfig(
      context={"attention": "ring", "load_balance": False}, sequence_parallel=True)
  notes = [r.getMessage() for r in caplog.records]
  assert len(notes) == 3 and "model.context_parallel is deprecated: it moved to parallel.context.attention" in notes[0]
  with pytest.raises(ConfigError, match="model.sequence_parallel=True and parallel.sequence_parallel=False disagree"):
    migrate_model_keys({"model": {"sequence_parallel": True}, "parallel": {"sequence_parallel": False}})


def test_checks_run_when_the_config_loads_with_the_sizes_known_then():
  with pytest.raises(ConfigError, match=r"model.num_layers=4: 4 pipelined layers do not split into mesh.stage=3 "
                                        r"groups; pipeline 3 or 6 layers, or use mesh.stage in \[2, 4\]"):
    load_config("tiny", ["mesh.stage=3"])
  with pytest.raises(ConfigError, match="mesh.tensor=3 does not divide model.num_heads=4"):
    load_config("tiny", ["mesh.tensor=3"])
  with pytest.raises(ConfigError, match="mesh.expert=3 does not divide model.moe.num_experts=8"):
    load_config("tiny-moe", ["mesh.expert=3"])
  # context=-1 is not known until the devices are: nothing to check yet, and no error.
  assert load_config("tiny", ["mesh.context=-1", "mesh.fsdp=1"]).plan().sizes["context"] == -1


def test_checks_run_again_on_the_real_mesh():
  config = small_config(mesh={"context": -1, "fsdp": 1}, data={"seq_len": 24})  # 8 context devices
  with pytest.raises(ConfigError, match=r"data.seq_len=24 must be a multiple of 16 to split over mesh.context=8"):
    from jaxpar.train.trainer import Trainer
    Trainer(config)
  config = small_config(mesh={"context": 2}, model={"attention": "flash"})
  with pytest.raises(ConfigError, match="model.attention='flash' runs in interpret mode on cpu"):
    Runtime.from_config(config)


def test_what_the_axes_do():
  config = small_config(mesh={"context": 2, "tensor": 2}, parallel={"context": {"attention": "ring"},
                                                                     "sequence_parallel": True})
  runtime = Runtime.from_config(config)
  plan = runtime.plan
  assert plan.splits_sequence and plan.load_balance and plan.sequence_parallel
  assert plan.execution_options.context_attention == "ring"
  assert dict(runtime.rules)["residual_length"] == ("context", "tensor")
  # Generation decodes whole sequences: it refuses this mesh, and lays the devices out its way.
  with pytest.raises(ConfigError, match="mesh.context=2: generation does not split sequences"):
    Engine(runtime, *runtime.init()[:1], None)
  assert plan.generation_sizes() == {**plan.sizes, "fsdp": 4, "context": 1}


def test_the_planner_enumerates_the_axes_the_plan_allows():
  moe = load_config("tiny-moe", ["data.global_batch_size=8", "data.seq_len=32", "model.moe.num_experts=4"])
  assert planner.layout_axes(moe) == ("data", "stage", "fsdp", "expert", "context", "tensor")
  found = planner.layouts(moe, 8)
  # 4 experts: expert 8 would split one; the plan's check drops those layouts.
  assert {l.expert for l in found} == {1, 2, 4} and all(l.devices == 8 for l in found)
  dense = small_config(model={"attention": "reference"}, data={"global_batch_size": 8})
  assert "context" not in planner.layout_axes(dense)  # the reference has no split form
  assert len(jax.devices()) == 8
