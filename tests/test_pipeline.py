"""Pipeline parallelism over `stage` (models/pipeline.py): GPipe and circular schedules on 8
simulated devices give the loss and every gradient of the unpipelined 1-device run in f32,
with the bubble iterations' inputs filled with NaN so that any leak shows.

A representative set rather than the full grid (each case is one compile): stage 2, 4 and
8 under GPipe, stage 2 and 4 under circular (stage 8 x 2 repeats would need a 16-layer
model), stage 2 x fsdp 2 x tensor 2 under both, microbatch counts from one per stage to two
per stage.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxpar.errors import ConfigError
from jaxpar.mesh import execution_options
from jaxpar.models.pipeline import bubble_fraction, reorder_layers, stage_major_order
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config, synthetic_batch

# 8 layers split into 2, 4 or 8 stages of 1 or 2 repeats; tiny widths keep compiles short.
MODEL = dict(embed_dim=32, num_layers=8, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=32)
DATA = dict(seq_len=16, global_batch_size=16)

CASES = {
  # name: (mesh sizes, parallel.pipeline)
  "gpipe_s2_m2": ({"stage": 2, "fsdp": 4}, {"microbatches": 2}),
  "gpipe_s4_m8": ({"stage": 4, "fsdp": 2}, {"microbatches": 8}),
  "gpipe_s8_m8": ({"stage": 8, "fsdp": 1}, {"microbatches": 8}),
  "circular_s2_r2_m4": ({"stage": 2, "fsdp": 4}, {"schedule": "circular", "repeats": 2, "microbatches": 4}),
  "circular_s4_r2_m4": ({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 2, "microbatches": 4}),
  "gpipe_s2_f2_t2_m4": ({"stage": 2, "fsdp": 2, "tensor": 2}, {"microbatches": 4}),
  "circular_s2_f2_t2_r2_m2": ({"stage": 2, "fsdp": 2, "tensor": 2},
                              {"schedule": "circular", "repeats": 2, "microbatches": 2}),
}


def pipeline_config(mesh, pipeline=None, model=None, data=None):
  return small_config(mesh=mesh, model=model or MODEL, data={**DATA, **(data or {})},
                      parallel={"pipeline": pipeline or {}})


def gradients_of(trainer, batch, *, fill=np.nan, accumulate=1):
  """(initial params, loss, grads, sums, new model state) of one gradient step (over
  `accumulate` accumulated microbatches), in canonical layer order; bubble inputs hold
  `fill` before they are masked."""
  params, model_state = trainer.runtime.init()
  options = trainer.runtime.plan.execution_options
  if options.pipeline is not None:
    options = dataclasses.replace(options, pipeline=dataclasses.replace(options.pipeline, bubble_fill=fill))
  gradients = jax.jit(make_gradients(trainer.graphdef, z_loss=0.0, microbatches=accumulate))
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
  with trainer.context(), execution_options(options):
    grads, sums, new_state = jax.device_get(gradients(params, batch, model_state))
  order = trainer.runtime.layer_order()
  canonical = lambda tree: reorder_layers(jax.device_get(tree), "layers", order, None)  # noqa: E731
  return (canonical(params), float(sums["ce_sum"] / sums["tokens"]), canonical(grads), sums,
          canonical(new_state))


def assert_trees_close(actual, expected, rtol):
  """`atol` is rtol times each leaf's largest value: f32 sums in another order differ by a
  few ulps of the largest term, whatever the leaf's scale."""
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference():
  config = pipeline_config({"fsdp": 1})
  return gradients_of(Trainer(config, devices=jax.devices()[:1]), synthetic_batch(config))


@pytest.fixture(scope="module", params=sorted(CASES))
def pipelined(request):
  mesh, pipeline = CASES[request.param]
  config = pipeline_config(mesh, pipeline)
  return gradients_of(Trainer(config), synthetic_batch(config))


def test_same_initial_params_loss_and_every_gradient_as_unpipelined(pipelined, reference):
  params, loss, grads, _, _ = pipelined
  assert_trees_close(params, reference[0], rtol=0)
  assert np.isfinite(loss) and loss == pytest.approx(reference[1], rel=1e-5)
  assert_trees_close(grads, reference[2], rtol=1e-5)


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
  with pytest.raises(ConfigError, match=r"8 pipelined layers do not split into mesh.stage=4 x "
                                        r"parallel.pipeline.repeats=3 = 12 groups; pipeline 12 layers"):
    pipeline_config({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 3, "microbatches": 4})
  with pytest.raises(ConfigError, match="parallel.pipeline.repeats=2 needs parallel.pipeline.schedule=circular"):
    pipeline_config({"stage": 2}, {"repeats": 2})
  with pytest.raises(ConfigError, match="parallel.pipeline.microbatches=2 is below mesh.stage=4"):
    pipeline_config({"stage": 4, "fsdp": 2}, {"schedule": "circular", "repeats": 2, "microbatches": 2})
  with pytest.raises(ConfigError, match="parallel.pipeline.microbatches=3 must divide the 16 rows"):
    pipeline_config({"stage": 2, "fsdp": 4}, {"microbatches": 3})
  with pytest.raises(ConfigError, match="mesh.context=2 with mesh.stage=2: context parallelism inside"):
    pipeline_config({"stage": 2, "context": 2, "fsdp": 2})

