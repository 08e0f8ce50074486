"""`jaxpar plan`: the enumeration respects the model and batch, the analytic memory model
splits the state the way the mesh does and prunes what cannot fit, and a compile-only plan
on 8 simulated devices writes a winner that loads as a config. (Timings: benchmarks only.)"""

import contextlib
import dataclasses
import os
import sys

import jax
import pytest

from jaxpar.aot import cost_model, plan
from jaxpar.aot.chips import CHIPS
from jaxpar.aot.cost_model import Hardware, Layout
from jaxpar.aot.plan import chip_hardware
from jaxpar.cli import main
from jaxpar.config import load_config, replace
from jaxpar.runtime import abstract_model, count_params
from tests.helpers import small_config

GIB = 2 ** 30


def test_layouts_cover_the_devices_and_respect_heads_and_batch():
  config = small_config(data={"global_batch_size": 8})  # 4 heads, 2 kv heads
  found = plan.layouts(config, 8)
  assert found and all(l.devices == 8 for l in found)
  assert {l.tensor for l in found} == {1, 2}  # 4 and 8 do not divide 2 kv heads
  assert all((8 // l.microbatches) % (l.data * l.fsdp * l.expert) == 0 for l in found)
  assert Layout(1, 8, 1, "none", 1) in found and Layout(8, 1, 1, "full", 1) in found
  # The plan lets a dense model split its 32-token sequences over context (zig-zag: 2
  # chunks a device, so up to 16), never over expert (no experts to hold).
  assert {l.context for l in found} == {1, 2, 4, 8} and {l.expert for l in found} == {1}


def test_default_layout_resolves_the_rest_axis():
  config = small_config(mesh={"tensor": 2})
  assert plan.default_layout(config, 8) == Layout(1, 4, 2, "none", 1)


def test_memory_model_splits_state_over_fsdp_and_tensor():
  config = load_config("llama3-8b")
  p = count_params(abstract_model(config.model)[1])
  dp = cost_model.memory_bytes(config, Layout(256, 1, 1, "full", 1), p)
  fsdp = cost_model.memory_bytes(config, Layout(1, 256, 1, "full", 1), p)
  # Replicated: params, Adam and grads alone are 16 bytes x 8B params = 120 GiB per chip.
  assert dp > 16 * p > 100 * GIB
  assert fsdp < 32 * GIB  # the shipped layout fits a v6e chip, as its compile shows
  remat_none = cost_model.memory_bytes(config, Layout(1, 256, 1, "none", 1), p)
  more_micro = cost_model.memory_bytes(config, Layout(1, 256, 1, "none", 3), p)
  assert remat_none > fsdp and more_micro < remat_none  # activations shrink with both


def test_rank_prunes_layouts_that_cannot_fit_but_keeps_the_default():
  config = load_config("llama3-8b")
  p = count_params(abstract_model(config.model)[1])
  v6e = Hardware("v6e", 32 * GIB, 918e12, 1638e9, 800e9, shared_host=False)
  ranked = plan.rank(config, 256, v6e, p)
  kept = {c.layout for c in ranked}
  assert Layout(256, 1, 1, "full", 1) not in kept  # plain DP: 120+ GiB of state per chip
  assert all(c.predicted_bytes <= plan.FIT_MARGIN * v6e.hbm_bytes or c.is_default
             for c in ranked)
  assert any(c.is_default for c in ranked)
  assert [c.predicted_s for c in ranked] == sorted(c.predicted_s for c in ranked)


def test_layouts_that_only_fit_with_narrower_moments_get_them_and_the_rest_keep_float32():
  """llama3-8b on a chip of 18 GiB: the planner keeps float32 moments wherever they fit and
  turns to bf16, then 8-bit moments for the layouts they alone make fit; the winner's
  overrides carry the choice. An optimizer that keeps float32 moments is never changed."""
  config = load_config("llama3-8b")
  p = count_params(abstract_model(config.model)[1])
  small = Hardware("small", 18 * GIB, 918e12, 1638e9, 800e9, shared_host=False)
  ranked = plan.rank(config, 256, small, p)
  by_moments = {}
  for c in ranked:
    by_moments.setdefault(c.layout.optimizer_state, []).append(c)
  assert set(by_moments) >= {None, "bfloat16", "int8_blockwise"}, set(by_moments)
  for c in ranked:
    if c.layout.optimizer_state is not None and not c.is_default:  # it did not fit any wider
      wider = dataclasses.replace(c.layout, optimizer_state=None)
      assert cost_model.memory_bytes(config, wider, p) > plan.FIT_MARGIN * small.hbm_bytes
      assert c.predicted_bytes <= plan.FIT_MARGIN * small.hbm_bytes
      assert c.layout.overrides()["train"]["optimizer_state_dtype"] == c.layout.optimizer_state
  f32 = by_moments[None][0].layout
  assert "optimizer_state_dtype" not in f32.overrides()["train"]
  # 8-bit moments save 8 - 2.06 bytes per parameter over this layout's shards.
  saved = cost_model.memory_bytes(config, f32, p) - cost_model.memory_bytes(
      config, dataclasses.replace(f32, optimizer_state="int8_blockwise"), p)
  assert saved == pytest.approx(p * (8 - 2 * (1 + 4 / 128)) / f32.state_shards / f32.tensor)
  muon = replace(config, train={"optimizer": "muon"})
  assert all(c.layout.optimizer_state is None for c in plan.rank(muon, 256, small, p))


def test_spearman():
  assert plan.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
  assert plan.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_compile_only_plan_on_8_cpu_devices_writes_a_loadable_winner(tmp_path):
  assert len(jax.devices()) == 8
  config = small_config(data={"global_batch_size": 8})
  out = tmp_path / "plan.yaml"
  shown = []

  @contextlib.contextmanager
  def phase(name):  # what `jaxpar plan` shows with a spinner while each candidate compiles
    shown.append(name)
    yield
  ok, rho = plan.run_plan(config, top=2, output=str(out), echo=lambda _: None, phase=phase)
  assert rho is None and len(ok) >= 2 and all(c.compiled["fits"] for c in ok)
  assert shown[0].startswith(f"candidate 1/{len(shown)}: data=") and str(ok[0].layout) in "".join(shown)
  winner = load_config(str(out))
  w = winner.mesh
  assert (w.data, w.fsdp, w.tensor, winner.model.remat, winner.train.microbatches) == (
      ok[0].layout.data, ok[0].layout.fsdp, ok[0].layout.tensor, ok[0].layout.remat,
      ok[0].layout.microbatches)
  assert winner.model.embed_dim == config.model.embed_dim  # everything else kept


def test_xla_lines_nobody_can_act_on_are_dropped_and_the_rest_kept(capfd):
  from jaxpar.aot.xla_log import drop_xla_lines
  with drop_xla_lines():
    os.write(2, b"W1124 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. The compiler "
                b"cannot go from sharding {devices=[4,1,1,2]} to {devices=[1,1,2,4]} efficiently\n")
    os.write(2, b"W1124 a real warning\n")
    print("python's stderr passes too", file=sys.stderr)
  err = capfd.readouterr().err
  assert "Involuntary" not in err and "a real warning" in err and "python's stderr passes too" in err


def test_measuring_a_topology_plan_is_a_one_line_error(capsys):
  assert main(["plan", "tiny", "--topology", "v5e-4", "--measure"]) == 2
  assert "drop --topology" in capsys.readouterr().err


def test_layouts_include_pipelines_that_become_the_configs_they_name():
  config = small_config(model={"num_layers": 4}, data={"global_batch_size": 16})
  found = plan.layouts(config, 8)
  piped = {(l.stage, l.pipeline_microbatches, l.repeats) for l in found if l.stage > 1}
  # GPipe with one and two microbatches per stage, circular with 2 repeats where 4 layers allow.
  assert {(2, 2, 1), (2, 4, 1), (2, 2, 2), (4, 4, 1), (4, 8, 1)} <= piped
  assert not any(l.stage == 8 or (l.stage == 4 and l.repeats > 1) for l in found)  # 4 layers
  for layout in (l for l in found if l.stage > 1 and l.microbatches == 1 and l.remat == "full"):
    p = replace(config, **layout.overrides()).plan()
    assert (p.stages, p.microbatches, p.repeats) == (layout.stage, layout.pipeline_microbatches, layout.repeats)
    assert p.config.pipeline.schedule == ("circular" if layout.repeats > 1 else "gpipe")


def test_across_slices_the_planner_puts_stage_or_data_on_dcn_not_fsdp():
  config = load_config("llama2-70b", ["data.global_batch_size=256"])
  p = count_params(abstract_model(config.model)[1])
  v5p = chip_hardware(CHIPS["v5p"])
  ranked = plan.rank(config, 64, v5p, p, num_slices=2)
  assert ranked[0].layout.dcn_axis in ("stage", "data") and ranked[0].layout.num_slices == 2
  assert {c.layout.dcn_axis for c in ranked} == {"stage", "data", "fsdp"}  # all were candidates
  # The best pipeline, and the same mesh with fsdp spanning the slices instead: then every
  # weight gather and gradient reduce-scatter crosses DCN, not just the hand-offs.
  staged = min((c for c in ranked if c.layout.dcn_axis == "stage"), key=lambda c: c.predicted_s)
  over_fsdp = dataclasses.replace(staged.layout, dcn_axis="fsdp")
  assert cost_model.step_seconds(config, over_fsdp, p, v5p) > 1.1 * staged.predicted_s


def test_precisions_asked_for_are_ranked_with_int8_projections_at_the_int8_peak():
  """--precisions int8: every layout is also tried at model.train_precision=int8; on a chip
  with an int8 peak twice bf16's the twin is predicted faster by half its projections' compute
  time, and its overrides set the precision. Unasked, no candidate changes the precision, and a
  chip without an int8 peak predicts no gain."""
  config = load_config("llama3-8b")
  p = count_params(abstract_model(config.model)[1])
  v6e = chip_hardware(CHIPS["v6e"])
  assert plan.rank(config, 256, v6e, p) and all(c.layout.train_precision is None
                                                 for c in plan.rank(config, 256, v6e, p))
  ranked = plan.rank(config, 256, v6e, p, precisions=("int8",))
  by_layout = {}
  for c in ranked:
    by_layout.setdefault(dataclasses.replace(c.layout, train_precision=None), {})[c.layout.train_precision] = c
  pairs = [both for both in by_layout.values() if len(both) == 2]
  assert pairs
  m, d = config.model, config.data
  int8_flops = cost_model.int8_flops_per_token(m, "int8", d.seq_len) * d.global_batch_size * d.seq_len
  assert 0 < int8_flops < cost_model.train_flops_per_token(m, d.seq_len) * d.global_batch_size * d.seq_len
  for both in pairs:
    layout = both[None].layout
    saved = int8_flops * cost_model.remat_factor(layout.remat) / (1 - layout.bubble) / 2 / (256 * v6e.peak_flops)
    assert both[None].predicted_s - both["int8"].predicted_s == pytest.approx(saved, rel=1e-6)
    assert both["int8"].layout.overrides()["model"]["train_precision"] == "int8"
    assert "train_precision" not in layout.overrides()["model"]
  no_int8 = dataclasses.replace(v6e, int8_flops=None)
  layout = pairs[0][None].layout
  assert cost_model.step_seconds(config, dataclasses.replace(layout, train_precision="int8"), p, no_int8) == \
      cost_model.step_seconds(config, layout, p, no_int8)
  with pytest.raises(Exception, match="train_precision='int4'"):
    plan.plan(config, precisions=("int4",))
