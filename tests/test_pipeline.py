"""Pipeline parallelism over `stage` (models/pipeline.py): GPipe and circular schedules on 8
simulated devices give the loss and every gradient of the unpipelined 1-device run in f32,
with the bubble iterations' inputs filled with NaN so that any leak shows.

A representative set rather than the full grid (each case is one compile): stage 2, 4 and
8 under GPipe and circular, stage 2 x fsdp 2 x tensor 2 under both, stage 2 x context 2 (ring
attention), microbatch counts from one per stage to two per stage; and MoE layers with
expert parallelism inside the stages.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.mesh import execution_options
from jaxpar.models.pipeline import bubble_fraction, reorder_layers, stage_major_order
from jaxpar.weights import relayout
from jaxpar.objectives.lm import lm_loss
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config, synthetic_batch

# 16 layers split into 2, 4 or 8 stages of 1 or 2 repeats (layers are scanned, so depth costs
# little compile time); tiny widths keep compiles short.
MODEL = dict(embed_dim=32, num_layers=16, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32)
DATA = dict(seq_len=16, global_batch_size=16)

CASES = {
  # name: (mesh sizes, parallel.pipeline[, the rest of the parallel section])
  "gpipe_s2_m2": ({"stage": 2, "fsdp": 4}, {"microbatches": 2}),
  "gpipe_s4_m8": ({"stage": 4, "fsdp": 2}, {"microbatches": 8}),
  "gpipe_s8_m8": ({"stage": 8, "fsdp": 1}, {"microbatches": 8}),
  "circular_s2_r2_m4": ({"stage": 2, "fsdp": 4}, {"schedule": "circular", "repeats": 2, "microbatches": 4}),
  "circular_s4_r2_m4": ({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 2, "microbatches": 4}),
  "circular_s8_r2_m8": ({"stage": 8, "fsdp": 1}, {"schedule": "circular", "repeats": 2, "microbatches": 8}),
  "gpipe_s2_f2_t2_m4": ({"stage": 2, "fsdp": 2, "tensor": 2}, {"microbatches": 4}),
  "circular_s2_f2_t2_r2_m2": ({"stage": 2, "fsdp": 2, "tensor": 2},
                              {"schedule": "circular", "repeats": 2, "microbatches": 2}),
  # Ring attention's own shard_map (ppermute over `context`) nested in the stages'.
  "gpipe_s2_c2_f2_ring_m2": ({"stage": 2, "context": 2, "fsdp": 2}, {"microbatches": 2},
                             {"context": {"attention": "ring"}}),
}

# DeepSeek-style: a dense first layer before the pipeline, then 4 MoE layers in 2 stages.
MOE = {**MODEL, "family": "deepseek", "num_layers": 5, "first_dense_layers": 1,
       "moe": {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 32}}


def pipeline_config(mesh, pipeline=None, model=None, data=None, parallel=None):
  return small_config(mesh=mesh, model=model or MODEL, data={**DATA, **(data or {})},
                      parallel={"pipeline": pipeline or {}, **(parallel or {})})


def gradients_of(trainer, batch, params, *, fill=np.nan, accumulate=1):
  """(loss, grads in canonical layer order) of one gradient step from `params` (canonical
  order, on the host), placed as the trainer's layout stores them; bubble inputs hold
  `fill` before they are masked; `accumulate`: gradient accumulation microbatches."""
  runtime = trainer.runtime
  params = relayout(params, None, runtime.layer_order(), runtime.param_shardings)
  options = runtime.plan.execution_options
  if options.pipeline is not None:
    options = dataclasses.replace(options, pipeline=dataclasses.replace(options.pipeline, bubble_fill=fill))
  gradients = jax.jit(make_gradients(lm_loss(trainer.graphdef, z_loss=0.0), microbatches=accumulate))
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
  with trainer.context(), execution_options(options):
    grads, sums, _ = jax.device_get(gradients(params, batch, {}))
  grads = reorder_layers(grads, "layers", runtime.layer_order(), None)
  return float(sums["ce_sum"] / sums["tokens"]), grads


def assert_trees_close(actual, expected, rtol):
  """`atol` is rtol times each leaf's largest value: f32 sums in another order differ by a
  few ulps of the largest term, whatever the leaf's scale."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference():
  """(initial params, loss, grads) on one device, unpipelined."""
  config = pipeline_config({"fsdp": 1})
  trainer = Trainer(config, devices=jax.devices()[:1])
  params = jax.device_get(trainer.runtime.init()[0])
  return (params, *gradients_of(trainer, synthetic_batch(config), params))


@pytest.fixture(scope="module", params=sorted(CASES))
def pipelined(request, reference):
  mesh, pipeline, *parallel = CASES[request.param]
  config = pipeline_config(mesh, pipeline, parallel=parallel[0] if parallel else None)
  return gradients_of(Trainer(config), synthetic_batch(config), reference[0])


def test_loss_and_every_gradient_equal_the_unpipelined_run(pipelined, reference):
  loss, grads = pipelined
  assert np.isfinite(loss) and loss == pytest.approx(reference[1], rel=1e-5)
  assert_trees_close(grads, reference[2], rtol=1e-5)


def test_moe_layers_with_expert_parallelism_inside_the_stages_match_the_unpipelined_run():
  # The load-balancing loss multiplies two means over the tokens, so it is a statistic of the
  # batch it sees: with 2 pipeline microbatches the reference accumulates the same 2 pieces
  # (train.microbatches) on one device. The aux losses must come out of the stages for the
  # router gradients to agree.
  reference = pipeline_config({"fsdp": 1}, model=MOE)
  trainer = Trainer(reference, devices=jax.devices()[:1])
  rng = np.random.default_rng(0)  # weights made on the host: no init program to compile
  params = jax.tree.map(lambda a: (0.1 * rng.standard_normal(a.shape)).astype(a.dtype),
                        trainer.abstract_state().params)
  expected_loss, expected = gradients_of(trainer, synthetic_batch(reference), params, accumulate=2)
  config = pipeline_config({"stage": 2, "expert": 2, "fsdp": 2}, {"microbatches": 2}, model=MOE)
  loss, grads = gradients_of(Trainer(config), synthetic_batch(config), params)
  assert np.isfinite(loss) and loss == pytest.approx(expected_loss, rel=1e-5)
  assert_trees_close(grads, expected, rtol=1e-5)


def test_a_circular_pipeline_initialises_the_same_model_stored_stage_major(reference):
  runtime = Trainer(pipeline_config(*CASES["circular_s4_r2_m4"])).runtime
  params = jax.device_get(runtime.init()[0])
  stored, canonical = jax.tree.leaves(params["layers"]), jax.tree.leaves(reference[0]["layers"])
  assert not all(np.array_equal(a, b) for a, b in zip(stored, canonical))  # not in canonical order ...
  assert_trees_close(reorder_layers(params, "layers", runtime.layer_order(), None), reference[0], rtol=0)  # ... same values


def test_stage_major_order_puts_each_stage_s_layers_together():
  # 2 stages x 2 repeats x 2 layers: stage 0 runs layers 0-1 then 4-5, stage 1 2-3 then 6-7.
  assert stage_major_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
  tree = {"layers": {"w": np.arange(8)}, "embed": np.arange(8)}
  moved = reorder_layers(tree, "layers", None, stage_major_order(8, 2, 2))
  assert moved["layers"]["w"].tolist() == [0, 1, 4, 5, 2, 3, 6, 7] and moved["embed"].tolist() == list(range(8))
  back = reorder_layers(moved, "layers", stage_major_order(8, 2, 2), stage_major_order(8, 4, 2))
  assert back["layers"]["w"].tolist() == stage_major_order(8, 4, 2).tolist()


def test_the_plan_checks_pipelines_and_names_what_would_work():
  plan = pipeline_config({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 2, "microbatches": 4}).plan()
  assert plan.bubble_fraction == pytest.approx(3 / 11) == bubble_fraction(4, 4, 2)
  assert "bubble 27.3% = (S-1)/(M*R+S-1) = 3/11" in plan.describe_pipeline()
  with pytest.raises(ConfigError, match=r"16 pipelined layers do not split into mesh.stage=4 x "
                                        r"parallel.pipeline.repeats=3 = 12 groups; pipeline 12 or 24 layers"):
    pipeline_config({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 3, "microbatches": 4})
  with pytest.raises(ConfigError, match="parallel.pipeline.repeats=2 needs parallel.pipeline.schedule=circular"):
    pipeline_config({"stage": 2}, {"repeats": 2})
  with pytest.raises(ConfigError, match="parallel.pipeline.microbatches=2 is below mesh.stage=4"):
    pipeline_config({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 2, "microbatches": 2})
  with pytest.raises(ConfigError, match="parallel.pipeline.microbatches=3 must divide the 16 rows"):
    pipeline_config({"stage": 2, "fsdp": 4}, {"microbatches": 3})


def test_cli_trains_tiny_on_four_stages_and_reports_the_bubble(tmp_path):
  run = subprocess.run(
      [sys.executable, "-m", "jaxpar", "train", "tiny", "mesh.stage=4", "data.global_batch_size=16",
       "data.seq_len=64", "train.steps=30", "train.log_every=0", "train.sample_tokens=4",
       f"train.run_dir={tmp_path}/run", "--no-progress"], capture_output=True, text=True, timeout=600,
      env={**os.environ, "JAX_DISABLE_MOST_OPTIMIZATIONS": "0"})  # 30 steps: optimizing pays (35 s -> 27 s)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "pipeline: 4 stages, gpipe, 4 microbatches: bubble 42.9% = (S-1)/(M*R+S-1) = 3/7" in run.stdout
  records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert all(r["pipeline_bubble"] == pytest.approx(3 / 7) for r in records)
  assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
  assert "sample" in run.stdout  # generation after pipelined training: the weights move to its layout


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_model_and_optimizer_state_per_device_fall_as_one_over_stage(stages):
  trainer = Trainer(pipeline_config({"stage": stages, "fsdp": 1}, {"microbatches": stages}),
                    devices=jax.devices()[:stages])
  state = trainer.abstract_state()
  leaves = jax.tree.leaves({"params": state.params, "opt_state": state.opt_state})
  total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
  per_device = sum(np.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in leaves)
  # The embedding and output projection split over `stage` as FSDP; only the last norm repeats.
  assert per_device == pytest.approx(total / stages, rel=0.01)


def _replica_groups(line) -> list[list[int]]:
  """An HLO collective's groups, from either way XLA writes them: {{0,1},{2,3}} or the
  iota form [groups,size]<=[dims]T(perm)."""
  listed = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]+\}(?:,\{[\d,]+\})*)\}", line)
  if listed:
    return [[int(d) for d in group.split(",")] for group in re.findall(r"\{([\d,]+)\}", listed.group(1))]
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  assert iota, f"no replica groups in {line[:300]}"
  dims = [int(d) for d in iota.group(3).split(",")]
  ids = np.arange(np.prod(dims)).reshape(dims)
  if iota.group(4):
    ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
  return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()


@pytest.fixture(scope="module")
def compiled_circular():
  """The train step of stage=4 x fsdp=2, circular with 2 repeats, at 4 and at 16 microbatches
  of one global batch: {microbatches: (trainer, compiled)}."""
  out = {}
  for microbatches in (4, 16):
    config = pipeline_config({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 2,
                                                      "microbatches": microbatches}, data={"global_batch_size": 32})
    trainer = Trainer(config)
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=trainer.batch_sharding)
             for k, v in synthetic_batch(config).items()}
    with trainer.context():
      out[microbatches] = trainer, trainer.train_step.lower(trainer.abstract_state(), batch).compile()
  return out


def test_temporaries_do_not_grow_with_the_microbatch_count(compiled_circular):
  # At one global batch, 4x the microbatches is 1/4 the activations in flight per iteration;
  # per-microbatch copies of the weight gradients (the known failure) would add 16x a stage's.
  few, many = (compiled_circular[m][1].memory_analysis().temp_size_in_bytes for m in (4, 16))
  assert many <= few * 1.05, (few, many)


def test_stages_hand_off_by_collective_permute_and_gather_only_their_own_weights(compiled_circular):
  trainer, compiled = compiled_circular[4]
  stage_of = {int(d.id): s for s, row in enumerate(trainer.mesh.devices.reshape(4, 2)) for d in row}
  forward = {(int(a.id), int(b.id)) for here, there in zip(trainer.mesh.devices.reshape(4, 2),
                                                           np.roll(trainer.mesh.devices.reshape(4, 2), -1, 0))
             for a, b in zip(here, there)}
  lines = compiled.as_text().splitlines()
  permutes = [{tuple(p) for p in _replica_groups(line)} for line in lines if " collective-permute(" in line]
  assert forward in permutes and {(b, a) for a, b in forward} in permutes  # forward pass, and its transpose
  gathers = [line for line in lines if re.search(r" all-gather(-start)?\(", line) and "shard_map" in line]
  assert gathers  # the FSDP gathers of each stage's layers, inside the pipeline
  for line in gathers:
    assert all(len({stage_of[d] for d in group}) == 1 for group in _replica_groups(line)), line[:300]
