"""MoE routing and expert compute, below the model: the grouped SwiGLU paths against their
reference (forward and gradients), the dispatch door on 1 device and with expert
parallelism on 8 simulated devices (dropless loses and duplicates nothing even when every
token picks the experts of one device; capacity and buffer drops are exactly the expected
assignments), the router, and auxiliary-loss-free balancing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import MeshConfig
from jaxpar.mesh import build_mesh, resolve_rules
from jaxpar.models import MoEConfig, router
from jaxpar.models.activations import clamped_swiglu
from jaxpar.pallas_kernels.moe import (grouped_ffn, grouped_ffn_reference, rank_within, routed_experts,
                                       routed_experts_reference, silu_glu, take_rows)

B, L, D, F, E, K = 8, 16, 32, 48, 8, 2
RNG = np.random.default_rng(0)


def _weights(e=E, d=D, f=F):
  return tuple(jnp.asarray(RNG.normal(size=s) / np.sqrt(s[1]), jnp.float32)
               for s in [(e, d, f), (e, d, f), (e, f, d)])


X = jnp.asarray(RNG.normal(size=(B, L, D)), jnp.float32)
RANDOM_IDS = jnp.asarray(np.argsort(RNG.random((B, L, E)), -1)[..., :K], jnp.int32)
# Every token's two experts live on the first EP device of any EP mesh: the worst skew.
SKEWED_IDS = jnp.asarray(np.stack([np.zeros((B, L)), np.ones((B, L))], -1), jnp.int32)
COMBINE = jnp.asarray(RNG.random((B, L, K)), jnp.float32)
GATE, UP, DOWN = _weights()
MESHES = {"ep2_fsdp4": {"expert": 2, "fsdp": 4}, "ep8": {"expert": 8, "fsdp": 1},
          "ep2_fsdp2_tp2": {"expert": 2, "fsdp": 2, "tensor": 2}}


@pytest.mark.parametrize("gpt_oss", [False, True])  # per-expert gate/up biases and the clamped SwiGLU
@pytest.mark.parametrize("implementation", ["blocked", "ragged"])
def test_grouped_ffn_matches_reference_forward_and_backward(implementation, gpt_oss):
  rows = jnp.asarray(RNG.normal(size=(100, D)), jnp.float32)
  # Uneven groups in any order, two experts unused, and rows of no expert (group E).
  groups = jnp.asarray(RNG.choice([0, 2, 3, 4, 6, 7, E], size=100, p=[.3, .1, .02, .2, .13, .1, .15]), jnp.int32)
  biases = tuple(jnp.asarray(RNG.normal(size=(E, F)), jnp.float32) for _ in range(2)) if gpt_oss else ()
  # A limit of 0.5 clamps many of these projections (|x @ w| ~ 1), so both sides of the clamp are tested.
  glu = functools.partial(clamped_swiglu, limit=0.5, alpha=1.702) if gpt_oss else silu_glu

  @jax.jit
  def run(rows, gate, up, down, *biases):
    def both(fn):
      return jax.value_and_grad(lambda *a: jnp.sum(jnp.sin(fn(a[0], groups, *a[1:4], biases=a[4:] or None, glu=glu))),
                                argnums=tuple(range(4 + len(biases))))(rows, gate, up, down, *biases)
    got = both(lambda *a, **k: grouped_ffn(*a, **k, implementation=implementation, block=8))
    return got, both(grouped_ffn_reference), grouped_ffn(rows, groups, gate, up, down, biases=biases or None,
                                                         glu=glu, implementation=implementation)
  (got, got_grads), (want, want_grads), out = run(rows, GATE, UP, DOWN, *biases)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)  # a sum of 3,200 terms, some cancelling
  for g, w in zip(got_grads, want_grads):
    assert np.abs(w).max() > 0
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max())
  assert not np.any(np.asarray(out)[np.asarray(groups) == E])  # rows of no expert stay zero


def test_auto_runs_every_expert_on_few_rows_and_blocks_on_many():
  """Decode's few rows go through every expert (no loop over padded blocks), a training
  batch's through the blocks; both equal the reference."""
  def run(num_rows):
    rows = jnp.asarray(RNG.normal(size=(num_rows, D)), jnp.float32)
    groups = jnp.asarray(RNG.integers(0, E + 1, num_rows), jnp.int32)  # some rows of no expert
    auto = lambda r, g: grouped_ffn(r, g, GATE, UP, DOWN)  # noqa: E731
    looped = any(eqn.primitive.name == "scan" for eqn in jax.make_jaxpr(auto)(rows, groups).jaxpr.eqns)
    np.testing.assert_allclose(auto(rows, groups), grouped_ffn_reference(rows, groups, GATE, UP, DOWN),
                               rtol=1e-5, atol=1e-5)
    return looped
  assert not run(16)  # 8 tokens x top-2: 16 x 8 rows of work, against a block of 128 for each expert
  assert run(4096)


@pytest.mark.parametrize("num_keys", [3, 100])  # a running count, and a sort past 64 keys
def test_rank_within_counts_in_index_order(num_keys):
  keys = RNG.integers(0, 3, 700)
  want = [int(np.sum(keys[:i] == keys[i])) for i in range(len(keys))]
  np.testing.assert_array_equal(rank_within(jnp.asarray(keys, jnp.int32), num_keys), want)


def test_take_rows_gradient_is_the_gather_transpose():
  x = jnp.asarray(RNG.normal(size=(6, 3)), jnp.float32)
  index = jnp.asarray([4, 0, 6, 4, 2, 0, 5], jnp.int32)  # 6: a zero row; rows 1 and 3 unread
  readers = jnp.asarray([[1, 5], [7, 7], [4, 7], [7, 7], [0, 3], [6, 7]], jnp.int32)  # 7: nobody
  weights = jnp.asarray(RNG.normal(size=(7, 3)), jnp.float32)
  loss = lambda fn: lambda x: jnp.sum(jnp.sin(fn(x) * weights))  # noqa: E731
  plain = jax.value_and_grad(loss(lambda x: jnp.take(x, index, axis=0, mode="fill", fill_value=0)))(x)
  ours = jax.value_and_grad(loss(lambda x: take_rows(x, index, readers)))(x)
  np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
  np.testing.assert_allclose(ours[1], plain[1], rtol=1e-6)


def _on_mesh(sizes, fn, *args):
  """(compiled HLO text, outputs) of jit(fn) on an 8-device mesh."""
  with jax.set_mesh(build_mesh(MeshConfig(**sizes))), nnx.logical_axis_rules(resolve_rules("fsdp_tp")):
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.as_text(), compiled(*args)


def test_dropless_dispatch_on_one_device_matches_reference_with_gradients():
  def loss(fn):
    return lambda x, c, g, u, d: jnp.sum(jnp.sin(fn(x, RANDOM_IDS, c, g, u, d)))
  blocked = functools.partial(routed_experts, implementation="blocked")  # auto takes every expert here
  both = jax.jit(lambda *a: (jax.grad(loss(lambda *b: blocked(*b)[0]), argnums=range(5))(*a),
                             jax.grad(loss(routed_experts_reference), argnums=range(5))(*a)))
  for g, w in zip(*both(X, COMBINE, GATE, UP, DOWN)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize("mesh,routing", [(None, "random"), ("ep2_fsdp4", "random"), ("ep8", "skewed"),
                                          ("ep2_fsdp2_tp2", "skewed")])
def test_dropless_dispatch_keeps_every_assignment_once(mesh, routing):
  ids = RANDOM_IDS if routing == "random" else SKEWED_IDS
  args = (X, ids, COMBINE, GATE, UP, DOWN)
  if mesh is None:  # blocked: auto would run every expert on these 128 tokens
    y, kept = jax.jit(functools.partial(routed_experts, implementation="blocked"))(*args)
  else:
    hlo, (y, kept) = _on_mesh(MESHES[mesh], routed_experts, *args)
    assert "all-to-all" in hlo
  assert bool(jnp.all(kept))
  # A lost assignment would miss its term, a duplicated one add it twice: y is the reference.
  np.testing.assert_allclose(y, routed_experts_reference(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mesh", [None, {"fsdp": 4, "tensor": 2}])
def test_decode_sized_dispatch_runs_every_expert_once_per_token(mesh):
  """8 tokens x top-2 over 8 local experts: every expert on each token, no buffers and no
  loop over padded blocks, on one device and with FSDP-gathered, tensor-split experts."""
  args = (X[:, :1], RANDOM_IDS[:, :1], COMBINE[:, :1], GATE, UP, DOWN)
  if mesh is None:
    compiled = jax.jit(routed_experts).lower(*args).compile()
    hlo, (y, kept) = compiled.as_text(), compiled(*args)
    # Each token through each expert once: running every expert on each token-choice row
    # (grouped_ffn's own fallback) would be twice this.
    assert compiled.cost_analysis()["flops"] < 1.1 * B * E * 3 * 2 * D * F
  else:
    hlo, (y, kept) = _on_mesh(mesh, routed_experts, *args)
  assert " while(" not in hlo and bool(jnp.all(kept))
  np.testing.assert_allclose(y, routed_experts_reference(*args), rtol=1e-5, atol=1e-5)


def _expected_kept(ids, rows_per_group, limit_fn):
  """numpy: per group of batch rows (one device's tokens), keep an assignment when its rank
  among the group's assignments with the same key (limit_fn's key) is below the limit,
  counting every token's first choice before any second choice."""
  ids = np.asarray(ids)
  kept = np.zeros(ids.shape, bool)
  for start in range(0, ids.shape[0], rows_per_group):
    group = ids[start:start + rows_per_group]
    keys, limit = limit_fn(group.reshape(-1, K).T.reshape(-1))  # choice-major
    seen = {}
    keep = []
    for key in keys:
      keep.append(seen.get(key, 0) < limit)
      seen[key] = seen.get(key, 0) + 1
    kept[start:start + rows_per_group] = np.asarray(keep).reshape(K, -1).T.reshape(group.shape)
  return kept


@pytest.mark.parametrize("mesh", [None, "ep2_fsdp4"])
def test_capacity_drops_exactly_the_assignments_past_capacity(mesh):
  factor = 0.75
  rows = B if mesh is None else B // 8  # batch rows per device (tokens split over fsdp x expert)
  capacity = int(np.ceil(factor * rows * L * K / E))
  want = _expected_kept(RANDOM_IDS, rows, lambda flat: (flat, capacity))
  assert 0 < (~want).sum() < want.size  # the test drops some, not all
  fn = lambda *a: routed_experts(*a, capacity_factor=factor)  # noqa: E731
  args = (X, RANDOM_IDS, COMBINE, GATE, UP, DOWN)
  y, kept = jax.jit(fn)(*args) if mesh is None else _on_mesh(MESHES[mesh], fn, *args)[1]
  np.testing.assert_array_equal(kept, want)
  dropped_weights = jnp.where(jnp.asarray(want), COMBINE, 0.0)
  np.testing.assert_allclose(y, routed_experts_reference(X, RANDOM_IDS, dropped_weights, GATE, UP, DOWN),
                             rtol=1e-5, atol=1e-5)


def test_bounded_ep_buffer_drops_exactly_the_overflow():
  mesh, ep = "ep2_fsdp4", 2
  rows = B // 8
  assignments = rows * L * K
  buffer = int(np.ceil(1.0 * assignments / ep))  # ep_buffer_factor=1: a balanced share
  # The skewed routing sends everything to EP device 0: each device keeps `buffer` of its
  # assignments (first choices first) and drops the rest, counted exactly.
  want = _expected_kept(SKEWED_IDS, rows, lambda flat: (flat // (E // ep), buffer))
  assert (~want).sum() == 8 * (assignments - buffer)
  fn = lambda *a: routed_experts(*a, ep_buffer_factor=1.0)  # noqa: E731
  y, kept = _on_mesh(MESHES[mesh], fn, X, SKEWED_IDS, COMBINE, GATE, UP, DOWN)[1]
  np.testing.assert_array_equal(kept, want)
  np.testing.assert_allclose(
      y, routed_experts_reference(X, SKEWED_IDS, jnp.where(jnp.asarray(want), COMBINE, 0.0), GATE, UP, DOWN),
      rtol=1e-5, atol=1e-5)


def test_router_softmax_and_sigmoid_top_k():
  logits = jnp.asarray(RNG.normal(size=(5, E)), jnp.float32)
  ids, weights, scores = router.route(logits, None, MoEConfig(num_experts=E, experts_per_token=3))
  probs = np.asarray(jax.nn.softmax(logits))
  np.testing.assert_array_equal(ids, np.argsort(-probs, axis=-1)[:, :3])
  top = np.take_along_axis(probs, np.asarray(ids), -1)
  np.testing.assert_allclose(weights, top / top.sum(-1, keepdims=True), rtol=1e-6)
  # Sigmoid with a bias: the bias picks the experts, the unbiased scores weigh them.
  bias = jnp.zeros(E).at[7].set(10.0)
  moe = MoEConfig(num_experts=E, router="sigmoid", normalize_weights=False, routed_scale=2.5)
  ids, weights, _ = router.route(logits, bias, moe)
  assert np.all(np.asarray(ids)[:, 0] == 7)
  np.testing.assert_allclose(weights[:, 0], 2.5 * jax.nn.sigmoid(logits[:, 7]), rtol=1e-6)
  load = router.load_fractions(jnp.asarray([[0, 1], [0, 2]]), 4)
  np.testing.assert_allclose(load, [0.5, 0.25, 0.25, 0.0])


def test_aux_loss_free_bias_evens_out_a_skewed_router():
  """A fixed, badly skewed router: repeated forward passes move the bias (model state, not
  a parameter) until the experts' load is far more even."""
  from jaxpar.config import from_dict
  from jaxpar.models.moe import MoE
  cfg = from_dict({"model": {"family": "deepseek", "embed_dim": D, "num_heads": 4, "num_kv_heads": 4,
                             "head_dim": 8, "moe": {"num_experts": E, "expert_mlp_dim": F,
                                                    "router": "sigmoid", "bias_update_rate": 0.02}}}).model
  with nnx.use_eager_sharding(False):
    block = MoE(cfg, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
  # Inputs share a mean direction that the router scores higher for higher experts.
  x = X + 1.0
  block.router[...] = block.router[...] + jnp.arange(E) / (2 * D)
  graphdef, params, bias = nnx.split(block, nnx.Param, ...)

  @jax.jit
  def forward(bias):
    module = nnx.merge(graphdef, params, bias)
    _, aux = module(x)
    return nnx.state(module, nnx.Not(nnx.Param)), aux["metrics"]["moe/imbalance"]
  imbalance = []
  for _ in range(60):
    bias, value = forward(bias)
    imbalance.append(float(value))
  assert imbalance[0] > 2.0, imbalance[0]  # the skew is real
  assert max(imbalance[-10:]) < 0.6 * imbalance[0], imbalance


def test_moe_config_mistakes_are_one_line_errors():
  from jaxpar.config import ConfigError, from_dict
  cases = {
    "model.mlp='moe' needs a model.moe section, which model.family='llama' does not have":
        {"model": {"mlp": "moe"}},
    "mesh.expert=3 does not divide model.moe.num_experts=8": {"model": {"family": "mixtral"}, "mesh": {"expert": 3}},
    "model.moe.experts_per_token=9 exceeds model.moe.num_experts=8":
        {"model": {"family": "qwen3_moe", "moe": {"experts_per_token": 9}}},
    "unknown config key 'model.moe.experts'": {"model": {"family": "mixtral", "moe": {"experts": 8}}},
    "model.moe.capacity_factor=0: Input should be greater than 0":
        {"model": {"family": "deepseek", "moe": {"capacity_factor": 0}}},
    "model.moe.router='topk'": {"model": {"family": "deepseek", "moe": {"router": "topk"}}},
    "mixture-of-experts models cannot be quantized yet":
        {"model": {"family": "mixtral", "quantization": {"mode": "int8"}}},
  }
  for message, tree in cases.items():
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
      from_dict(tree)
    assert "\n" not in str(error.value)
