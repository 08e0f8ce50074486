"""`model.train_precision`: the projections' matmuls in fp8 or int8 while training.

The door (models/low_precision.py, through qwix) equals the plain-jnp definition of each scheme
(models/low_precision_reference.py) forward and backward; its gradients are straight-through
(they match finite differences of the float layer within the scheme's rounding); in a model,
exactly the projections' matmuls are low-precision, and a few steps of training stay beside
the float run."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.errors import ConfigError
from jaxpar.models import build_model, low_precision
from jaxpar.models.low_precision import low_precision_matmul
from jaxpar.models.low_precision_reference import reference_matmul
from tests.helpers import SMALL_MODEL

# The schemes without state (fp8_delayed's history: tests/test_fp8_delayed.py).
SCHEMES = tuple(s for s in low_precision.SCHEMES if s != "fp8_delayed")
KEYS = jax.random.split(jax.random.key(0), 3)
# K = 384 and M = 256 split in 128-wide tiles; N = 192 does not (fp8_blockwise: one scale per row).
X = jax.random.normal(KEYS[0], (256, 384))
W = jax.random.normal(KEYS[1], (384, 192)) * 0.05
G = jax.random.normal(KEYS[2], (256, 192))
NOISE = jax.random.key(42)  # int8_stochastic's rounding noise


def _value_and_grads(matmul, scheme, dtype, cast, x, w, g):
  y, back = jax.vjp(lambda x, w: matmul(x.astype(cast), w.astype(cast), scheme).astype(dtype),
                    x.astype(dtype), w.astype(dtype))
  return (y, *back(g.astype(dtype)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_door_equals_the_schemes_definition(scheme):
  """f32 operands: forward, dx and dw equal the reference bitwise (fp8_blockwise: to f32
  rounding, its tiles are summed in another order). bf16 operands: the door quantizes them as
  f32 (qwix would otherwise accumulate in bf16), so it equals the reference on their f32 values."""
  door = jax.jit(_value_and_grads, static_argnums=(0, 1, 2, 3))
  # int8_stochastic: a scope's first projection draws dx's and dw's noise from split(fold_in(key, 0)).
  keys = tuple(jax.random.split(jax.random.fold_in(NOISE, 0))) if scheme == "int8_stochastic" else None
  for dtype in (jnp.float32, jnp.bfloat16):
    with low_precision.rounding_noise(NOISE):
      ours = door(low_precision_matmul, scheme, dtype, dtype, X, W, G)
    reference = door(functools.partial(reference_matmul, keys=keys), scheme, dtype, jnp.float32, X, W, G)
    for name, a, b in zip(("y", "dx", "dw"), ours, reference):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      if scheme == "fp8_blockwise":  # one bf16 step where two f32 sums round across it
        tolerance = 1e-6 if dtype == jnp.float32 else 2 ** -7
        assert np.abs(a - b).max() <= tolerance * np.abs(b).max(), (name, dtype)
      else:
        np.testing.assert_array_equal(a, b, err_msg=f"{name} {dtype}")



def test_fp8_blockwise_scales_the_weight_per_128_by_128_block():
  """One huge entry coarsens its own 128 x 128 block of the weight and no other: through an
  identity the forward returns the quantized weight and the input's gradient its transpose, and
  the rest of the outlier's block rounds to zero (its rows and columns alike), while the blocks
  beside it keep e4m3's precision of their own largest entry."""
  w = (jax.random.normal(KEYS[1], (256, 256)) * 0.05).at[0, 0].set(1e6)
  eye = jnp.eye(256)
  y, back = jax.vjp(lambda x, w: low_precision_matmul(x, w, "fp8_blockwise"), eye, w)
  dx = back(eye)[0]
  for name, got in (("forward", y), ("input gradient", dx.T)):
    got, w_ = np.asarray(got), np.asarray(w)
    assert abs(got[0, 0] - 1e6) <= 1e-6 * 1e6 and not got[:128, :128].ravel()[1:].any(), name
    for rows, cols in ((slice(0, 128), slice(128, 256)), (slice(128, 256), slice(0, 128)),
                       (slice(128, 256), slice(128, 256))):
      block = w_[rows, cols]
      assert np.abs(got[rows, cols] - block).max() <= 2 ** -4 * np.abs(block).max(), (name, rows, cols)

# Relative error of each scheme's gradients against the float layer's, on these operands:
# e5m2 keeps 2 mantissa bits (fp8 gradients ~7%), int8 ~1.5%.
ROUNDING = {"fp8": 0.1, "fp8_blockwise": 0.1, "int8": 0.03, "int8_stochastic": 0.05}


def test_stochastic_rounding_is_unbiased_and_keyed_by_step():
  """Averaged over 64 keys, int8_stochastic's weight gradient comes within half of nearest
  rounding's error of the gradient the unrounded incoming gradient gives (x as the forward
  quantized it): nearest rounding's error is a bias, stochastic rounding's averages away. One key
  gives one answer every time; another key another."""
  from jaxpar.models.low_precision_reference import quantize
  vx, sx = quantize(X, jnp.int8, 1)
  unrounded = (vx.astype(jnp.float32) * sx).T @ G

  def dw(scheme, key):
    with low_precision.rounding_noise(key):
      return jax.vjp(lambda w: low_precision_matmul(X, w, scheme), W)[1](G)[0]
  nearest = jax.jit(lambda: dw("int8", NOISE))()
  stochastic = jax.jit(jax.vmap(lambda key: dw("int8_stochastic", key)))(jax.random.split(NOISE, 64))
  error = lambda a: float(jnp.linalg.norm(a - unrounded))  # noqa: E731
  assert error(stochastic.mean(axis=0)) < 0.5 * error(nearest), (error(stochastic.mean(axis=0)), error(nearest))
  again = jax.jit(lambda key: dw("int8_stochastic", key))
  np.testing.assert_array_equal(again(NOISE), again(NOISE))
  assert not np.array_equal(again(NOISE), again(jax.random.key(1)))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_gradients_are_straight_through(scheme):
  """The door's gradients are the float layer's within the scheme's rounding, and along the
  float gradient's direction they match the float layer's central finite difference within a
  fifth of it: the quantizer's zero derivative never reaches them, nor does a wrong scale."""
  c = jax.random.normal(jax.random.key(7), (256, 192))
  loss = lambda x, w: jnp.sum(low_precision_matmul(x, w, scheme) * c)  # noqa: E731
  float_loss = lambda x, w: jnp.sum((x @ w) * c)  # noqa: E731
  grads = jax.grad(loss, argnums=(0, 1))(X, W)
  float_grads = jax.grad(float_loss, argnums=(0, 1))(X, W)
  h = 1e-2
  for i, (grad, float_grad) in enumerate(zip(grads, float_grads)):
    assert jnp.linalg.norm(grad - float_grad) <= ROUNDING[scheme] * jnp.linalg.norm(float_grad)
    direction = float_grad / jnp.linalg.norm(float_grad)
    shifted = lambda d: float_loss(*[(X, W)[j] + (d if j == i else 0) for j in (0, 1)])  # noqa: E731
    difference = (shifted(h * direction) - shifted(-h * direction)) / (2 * h)
    assert abs(float(jnp.sum(grad * direction)) - float(difference)) <= ROUNDING[scheme] / 5 * float(difference)


def _model(**overrides):
  return build_model(ModelConfig(**{**SMALL_MODEL, "embed_dim": 128, "mlp_dim": 256, **overrides}),
                     nnx.Rngs(0))


def _moe_model(**overrides):
  from jaxpar.config import from_dict
  moe = {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 128, "shared_mlp_dim": 64}
  model = {"family": "mixtral", **SMALL_MODEL, "embed_dim": 128, "moe": moe, **overrides}
  return build_model(from_dict({"model": model}).model, nnx.Rngs(0))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 258, (4, 32)), jnp.int32)


def _loss(model):
  logits = model(TOKENS[:, :-1])[0]
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], -1))


def _dots(model):
  """The gradient step's dot_generals, as (lhs, rhs) operand types, from its StableHLO."""
  text = nnx.jit(nnx.grad(_loss)).lower(model).as_text()
  lines = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  return [tuple(t.split("x")[-1] for t in line.rsplit(": (", 1)[1].split(")")[0].split(", "))
          for line in lines]


@pytest.mark.parametrize("scheme,low", [("fp8", "f8E4M3FN"), ("fp8_delayed", "f8E4M3FN"), ("fp8_blockwise", "f8E4M3FN"),
                                        ("int8", "i8")])
def test_only_the_projections_run_in_low_precision(scheme, low):
  """Each layer's 7 projections (q, k, v, o, gate, up, down) run 3 low-precision dots each
  (forward, dx, dw; the layers are scanned, so the body appears once); fp8's gradients are
  e5m2. The attention scores, the output projection and their gradients stay float."""
  plain, quantized = _dots(_model()), _dots(_model(train_precision=scheme))
  is_low = lambda types: any(t.startswith(low) or t.startswith("f8E5M2") for t in types)  # noqa: E731
  assert not any(map(is_low, plain))
  low_dots = [d for d in quantized if is_low(d)]
  float_dots = [d for d in quantized if not is_low(d)]
  # fp8_blockwise's tiles run as a batch dimension of one dot per matmul.
  assert len(low_dots) == 3 * 7
  assert float_dots and len(float_dots) == len(plain) - 3 * 7
  if scheme.startswith("fp8"):
    assert sum("f8E5M2" in d for d in map("".join, low_dots)) == 2 * 7


def _adam_losses(build, scheme):
  """Ten Adam steps of build(train_precision=scheme) on one batch: the losses."""
  import optax
  model = build(train_precision=scheme)
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(_loss)(model)
    optimizer.update(model, grads)
    return loss
  return np.array([float(step(model, optimizer)) for _ in range(10)])


@pytest.mark.parametrize("build, margins", [
    (_model, (("fp8", 0.02), ("fp8_blockwise", 0.02), ("int8", 0.005))),
    (_moe_model, (("fp8", 0.02), ("int8", 0.005)))], ids=["dense", "moe"])
def test_training_steps_stay_beside_the_float_run(build, margins):
  """Ten Adam steps on one batch: every scheme's loss falls as the float run's does, within the
  rounding this model shows (fp8: 2%, int8: 0.5% of the float loss); the MoE model's experts
  and shared expert quantized too."""
  float_losses = _adam_losses(build, "compute_dtype")
  assert float_losses[-1] < float_losses[0] - 0.5
  for scheme, margin in margins:
    losses = _adam_losses(build, scheme)
    assert np.abs(losses - float_losses).max() <= margin * float_losses[0], (scheme, losses, float_losses)


def _expert_blocks_reference(rows, groups, gate, up, down, scheme, block):
  """Each expert's rows, in order and padded with zero rows to one block, through the
  scheme's definition: what the grouped path computes when every group fits in a block."""
  mm = functools.partial(reference_matmul, scheme=scheme)
  y = jnp.zeros_like(rows)
  for e in range(gate.shape[0]):
    index = np.flatnonzero(groups == e)
    x = jnp.zeros((block, rows.shape[1]), rows.dtype).at[:len(index)].set(rows[index])
    out = mm(jax.nn.silu(mm(x, gate[e])) * mm(x, up[e]), down[e])
    y = y.at[index].set(out[:len(index)])
  return y


def _close(a, b, tolerance, what):
  a, b = np.asarray(a), np.asarray(b)
  assert np.abs(a - b).max() <= tolerance * np.abs(b).max(), (what, np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("scheme", ["fp8", "fp8_blockwise", "int8"])
def test_experts_grouped_matmuls_equal_the_schemes_definition(scheme):
  """The experts' grouped SwiGLU (the blocked path) with the door as its matmul: equal to the
  same path with the scheme's definition as its matmul, bitwise (fp8_blockwise to f32 rounding),
  outputs and the gradients of the rows and of every expert's three weights; and equal to each
  expert's rows, padded to one block, through the definition: outputs to f32 rounding, gradients
  too for fp8 and within one int8 level for int8 (another XLA program rounds the SwiGLU's
  gradient an ulp apart, which can move a value across an int8 rounding boundary). Rows of no
  expert stay zero; the every-expert path (decode's) agrees as closely."""
  from jaxpar.pallas_kernels.moe import grouped_ffn
  e, d, f, block = 3, 128, 256, 128
  keys = jax.random.split(jax.random.key(3), 5)
  rows = jax.random.normal(keys[0], (96, d))
  groups = np.random.default_rng(1).integers(0, e + 1, 96)  # e: routed nowhere
  gate, up = (jax.random.normal(k, (e, d, f)) * 0.05 for k in keys[1:3])
  down = jax.random.normal(keys[3], (e, f, d)) * 0.05
  cotangent = jax.random.normal(keys[4], (96, d))
  names = ("y", "d rows", "d gate", "d up", "d down")

  def value_and_grads(fn):
    y, back = jax.vjp(fn, rows, gate, up, down)
    return (y, *back(cotangent))

  def grouped(matmul, implementation="blocked"):
    return jax.jit(lambda: value_and_grads(lambda *a: grouped_ffn(
        a[0], jnp.asarray(groups), *a[1:], implementation=implementation, block=block, matmul=matmul)))()
  blocked = grouped(functools.partial(low_precision_matmul, scheme=scheme))
  definition = grouped(functools.partial(reference_matmul, scheme=scheme))
  assert not np.asarray(blocked[0])[groups == e].any()
  for name, a, b in zip(names, blocked, definition):
    if scheme == "fp8_blockwise":
      _close(a, b, 1e-6, name)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  per_expert = jax.jit(lambda: value_and_grads(lambda *a: _expert_blocks_reference(
      a[0], groups, *a[1:], scheme, block)))()
  gradients = 1 / 127 if scheme == "int8" else 1e-6
  for i, (name, a, b) in enumerate(zip(names, blocked, per_expert)):
    _close(a, b, 1e-6 if i == 0 else gradients, name)
  if scheme == "int8":  # per-row scales: all rows at once scale as each expert's rows do
    every = grouped(functools.partial(low_precision_matmul, scheme=scheme), "reference")
    for i, (name, a, b) in enumerate(zip(names, every, blocked)):
      _close(a, b, 1e-6 if i == 0 else gradients, f"every expert: {name}")


def test_moe_experts_and_shared_expert_run_in_low_precision():
  """In an MoE layer the experts' three projections and the shared expert's three run three
  int8 dots each, beside attention's four projections; the router stays float."""
  plain, quantized = _dots(_moe_model()), _dots(_moe_model(train_precision="int8"))
  is_low = lambda types: any(t.startswith("i8") for t in types)  # noqa: E731
  assert not any(map(is_low, plain))
  assert len([d for d in quantized if is_low(d)]) == 3 * (4 + 3 + 3)
  assert len([d for d in quantized if not is_low(d)]) == len(plain) - 3 * (4 + 3 + 3)


def test_refusals_and_the_emulation_line(caplog):
  with pytest.raises(ValueError, match="set one of the two"):
    ModelConfig(**SMALL_MODEL, train_precision="fp8", quantization={"mode": "int8"})
  from jaxpar.config import from_dict
  moe = from_dict({"model": {"family": "mixtral", **SMALL_MODEL, "train_precision": "int8",
                             "moe": {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 64,
                                     "implementation": "ragged"}}}).model
  with pytest.raises(ConfigError, match="moe.implementation=ragged multiplies in the compute dtype only"):
    build_model(moe, nnx.Rngs(0))
  low_precision._say_emulated.cache_clear()
  with caplog.at_level(logging.WARNING, logger="jaxpar.models.low_precision"):
    for _ in range(2):
      jax.jit(lambda x, w: low_precision_matmul(x, w, "fp8")).lower(X, W)
  assert [r.getMessage().split(":")[0] for r in caplog.records] == ["model.train_precision=fp8"]
  assert "no fp8 matmul units" in caplog.records[0].getMessage()


def test_native_table():
  class Device:
    def __init__(self, platform, device_kind, compute_capability=None):
      self.platform, self.device_kind = platform, device_kind
      if compute_capability:
        self.compute_capability = compute_capability
  assert low_precision.native("fp8", Device("gpu", "NVIDIA H100 80GB HBM3", "9.0"))
  assert not low_precision.native("fp8", Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"))
  assert low_precision.native("int8", Device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"))
  assert low_precision.native("int8", Device("tpu", "TPU v6 lite"))
  assert not low_precision.native("fp8", Device("tpu", "TPU v6 lite"))
  assert not low_precision.native("int8", Device("cpu", "cpu"))


@pytest.mark.tpu
@pytest.mark.parametrize("topology,scheme,low,build,dots", [
    ("v6e:2x2", "int8", "s8", _model, 21), ("v5p:2x2x1", "fp8", "f8e4m3fn", _model, 21),
    ("v5p:2x2x1", "fp8_delayed", "f8e4m3fn", _model, 21),
    ("v6e:2x2", "int8", "s8", _moe_model, 30)], ids=["v6e-int8", "v5p-fp8", "v5p-fp8-delayed", "v6e-int8-moe"])
def test_tpu_programs_keep_the_low_precision_operands(topology, scheme, low, build, dots, caplog):
  """Compiled for a TPU topology (libtpu, no chip), the gradient step's projection dots (21 a
  layer, 2 layers; an MoE layer: attention's 12, the experts' 9 and the shared expert's 9)
  take their operands in the scheme's type: libtpu does not widen them first."""
  from jax.experimental import topologies

  from jaxpar.aot import hlo
  device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  graph, state = nnx.split(nnx.eval_shape(lambda: build(train_precision=scheme, compute_dtype="bfloat16")))
  abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)  # noqa: E731
  grad = jax.jit(jax.grad(lambda state: _loss(nnx.merge(graph, state))))
  mesh = jax.sharding.Mesh(np.array([device]), ("data",))
  low_precision._say_emulated.cache_clear()
  with jax.set_mesh(mesh), caplog.at_level(logging.WARNING, logger="jaxpar.models.low_precision"):
    text = grad.lower(jax.tree.map(abstract, state)).compile().as_text()
  # The line names the chip compiled for, not this host: int8 runs on v6e's units, fp8 on
  # v5p is announced as emulated.
  assert [r.getMessage() for r in caplog.records if device.device_kind in r.getMessage()] == (
      [] if scheme == "int8" else [caplog.records[0].getMessage()])
  # The report's count (jaxpar/aot/hlo.py), which `jaxpar compile` prints.
  narrow = {f"{low} x {low}", f"f8e5m2 x {low}", f"{low} x f8e5m2"}  # fp8's gradients are e5m2
  assert sum(n for types, n in hlo.matmul_types(hlo.Module(text)).items() if types in narrow) == 2 * dots


def test_each_train_step_rounds_with_noise_of_its_own():
  """Through the train step's update (two microbatches, scanned layers): the same step gives the
  same parameters every time, the next step's noise others, and both differ from nearest
  rounding's."""
  import optax
  from jaxpar.config import MeshConfig
  from jaxpar.objectives.lm import lm_loss
  from jaxpar.runtime import Runtime
  from jaxpar.train.step import make_update
  from tests.helpers import small_config, synthetic_batch

  def updated(scheme, step):
    runtime = Runtime(ModelConfig(**SMALL_MODEL, train_precision=scheme), MeshConfig(fsdp=1), jax.devices()[:1])
    params, model_state = runtime.init()
    optimizer = optax.sgd(1.0)
    update = make_update(lm_loss(runtime.graphdef, z_loss=0.0, logits_chunk_len=0), optimizer, lambda s: 1.0,
                         microbatches=2)
    batch = synthetic_batch(small_config(data={"global_batch_size": 4}))
    with runtime.context():
      new = jax.jit(update)(params, optimizer.init(params), model_state, None, jnp.asarray(step), batch)[0]
    return np.asarray(new["layers"]["mlp"]["down"])

  first = updated("int8_stochastic", 0)
  np.testing.assert_array_equal(updated("int8_stochastic", 0), first)
  assert not np.array_equal(updated("int8_stochastic", 1), first)
  assert not np.array_equal(updated("int8", 0), first)
