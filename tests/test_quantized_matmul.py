"""Quantized matmul: packing, quantizers, the TPU (Mosaic) and GPU (Triton) kernels in
interpret mode against the pure-jnp reference, and the one door on a sharded mesh.

Tolerances, relative to the largest reference output: W8A8 is exact (int32 sums, the same
float epilogue). W8A16 / W4A16 widen the same weights to x's dtype and sum the same
products in float32, in another order: 1e-5 for f32 inputs; bf16 outputs may differ by one
rounding of the output (2^-8 relative) -> 1e-2.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.errors import UserError
from jaxpar import pallas_kernels
from jaxpar.pallas_kernels import MatmulBlocks, QuantizedWeight, quantize_weight
from jaxpar.pallas_kernels.matmul import packing, quantize, reference
from jaxpar.pallas_kernels.matmul.gpu import quantized_matmul_gpu
from jaxpar.pallas_kernels.matmul.tpu import quantized_matmul_tpu

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _inputs(m, k, n, dtype=jnp.float32, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (m, k), dtype), jax.random.normal(kw, (k, n), jnp.float32)


def _relative(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("bits,axis,group", [(4, 0, 32), (4, 1, 128), (2, 1, 64), (8, 0, 16)])
def test_pack_unpack_round_trip(bits, axis, group):
  shape = (group * 3, 5) if axis == 0 else (5, group * 2)
  values = jax.random.randint(jax.random.key(bits), shape, 0, 2 ** bits)
  packed = packing.pack(values, bits, axis, group)
  assert packed.dtype == jnp.int8 and packed.shape[axis] == shape[axis] * bits // 8
  np.testing.assert_array_equal(packing.unpack(packed, bits, axis, group), values)


def test_int4_packing_is_planar_within_groups():
  """Byte i of a group holds value i (low nibble) and value i + G/2 (high nibble)."""
  values = jnp.arange(64).reshape(64, 1) % 16
  packed = np.asarray(packing.pack(values, 4, 0, 32)).view(np.uint8)[:, 0]
  assert packed[0] == values[0, 0] | (values[16, 0] << 4)
  assert packed[16] == values[32, 0] | (values[48, 0] << 4)


@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, True), (4, False), (2, False)])
def test_quantize_int_error_is_at_most_half_a_step(bits, symmetric):
  x = jax.random.normal(jax.random.key(0), (6, 128)) * jnp.arange(1, 7)[:, None]
  x = x.at[0].set(3.0 * (not symmetric))  # constant (asymmetric) / zero rows round-trip exactly
  q, scale, zero = quantize.quantize_int(x, bits, axis=-1, symmetric=symmetric)
  lo, hi = (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1) if symmetric else (0, 2 ** bits - 1)
  assert int(q.min()) >= lo and int(q.max()) <= hi
  error = jnp.abs(quantize.dequantize_int(q, scale, zero) - x)
  assert bool(jnp.all(error <= scale / 2 * (1 + 1e-5)))
  assert float(error[0].max()) == 0.0


@pytest.mark.parametrize("mode,group,zero_point", [("int8", None, False), ("int4", 32, False),
                                                   ("int4", 128, True), ("w8a8", None, False)])
def test_quantize_weight_round_trip_and_bytes(mode, group, zero_point):
  k, n = 256, 96
  w = jax.random.normal(jax.random.key(1), (k, n))
  qw = quantize_weight(w, mode, group, zero_point=zero_point)
  step = qw.scales if mode != "int4" else jnp.repeat(qw.scales, group, axis=0)
  assert bool(jnp.all(jnp.abs(pallas_kernels.dequantize_weight(qw) - w) <= step / 2 * (1 + 1e-5)))
  assert qw.values.nbytes == k * n // (2 if mode == "int4" else 1)
  groups = k // group if mode == "int4" else 1
  assert qw.nbytes == qw.values.nbytes + 4 * groups * n * (2 if zero_point else 1)


# (mode, group, zero_point, m, k, n, dtype): m, n not multiples of the tiles; k = 320 is no
# multiple of a 128-lane tile (the weight is padded), k = 384 spans several K tiles.
F32, BF16 = jnp.float32, jnp.bfloat16
CASES = [("int8", None, False, 37, 384, 200, F32), ("int8", None, False, 5, 320, 136, BF16),
         ("int4", 32, False, 37, 320, 200, F32), ("int4", 64, True, 9, 384, 136, BF16),
         ("int4", 128, True, 1, 384, 72, F32), ("w8a8", None, False, 37, 320, 200, F32)]
IDS = [f"{c[0]}-g{c[1]}-{'asym' if c[2] else 'sym'}-{c[3]}x{c[4]}x{c[5]}-{jnp.dtype(c[6]).name}"
       for c in CASES]
KERNELS = {"tpu": functools.partial(quantized_matmul_tpu, blocks=MatmulBlocks(32, 128, 256)),
           "gpu": functools.partial(quantized_matmul_gpu, blocks=MatmulBlocks(16, 64, 64))}


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("mode,group,zero_point,m,k,n,dtype", CASES, ids=IDS)
def test_kernel_interpret_matches_reference(backend, mode, group, zero_point, m, k, n, dtype):
  x, w = _inputs(m, k, n, dtype)
  qw = quantize_weight(w, mode, group, zero_point=zero_point)
  kernel = jax.jit(functools.partial(KERNELS[backend], interpret=True))
  if mode == "w8a8":  # the kernels see int8 activations whatever the model dtype
    xq, xs = quantize.quantize_rows(x)
    np.testing.assert_array_equal(kernel(xq, qw, xs), reference.w8a8_reference(xq, xs, qw))
    return
  got = kernel(x, qw).astype(dtype)
  want = reference.weight_only_reference(x, qw).astype(dtype)
  assert _relative(got, want) < TOLERANCE[dtype]


# Relative output error of each mode against the float matmul on random normal weights and
# activations (a stated bound, asserted; the measured values sit at about half of it).
ERROR_BOUNDS = {("int8", None): 0.01, ("w8a8", None): 0.02, ("int4", 32): 0.12, ("int4", 128): 0.16}


@pytest.mark.parametrize("mode,group", list(ERROR_BOUNDS), ids=[f"{m}-{g}" for m, g in ERROR_BOUNDS])
def test_output_error_against_float_on_random_weights(mode, group):
  x, w = _inputs(64, 512, 256)
  got = pallas_kernels.quantized_matmul(x, quantize_weight(w, mode, group))
  assert _relative(got, x @ w) < ERROR_BOUNDS[(mode, group)]


def test_outlier_channels_cut_w8a8_error_on_outlier_activations():
  x, w = _inputs(64, 512, 256)
  x = x.at[:, 7].multiply(80.0).at[:, 300].multiply(-60.0)  # two outlier channels
  qw = quantize_weight(w, "w8a8")
  plain = _relative(pallas_kernels.quantized_matmul(x, qw), x @ w)
  kept = _relative(pallas_kernels.quantized_matmul(x, qw, outlier_channels=4), x @ w)
  assert kept < plain / 4, (kept, plain)
  pallas = pallas_kernels.quantized_matmul(x, qw, outlier_channels=4, implementation="pallas")
  assert _relative(pallas, pallas_kernels.quantized_matmul(x, qw, outlier_channels=4)) < 1e-6


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32), ("w8a8", None)])
def test_sharded_door_matches_xla_for_column_and_row_parallel(mode, group):
  """data 2 x fsdp 2 x tensor 2: N split (column parallel) and K split (row parallel, the
  per-device partial products summed), against the unsharded XLA path."""
  mesh = jax.make_mesh((2, 1, 2, 1, 1, 2), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 6)
  x, w = _inputs(8, 256, 128)
  qw = quantize_weight(w, mode, group)
  want = pallas_kernels.quantized_matmul(x, qw, implementation="xla")
  for names in ((None, "act_mlp"), ("act_mlp", None)):
    run = jax.jit(lambda x, qw: pallas_kernels.quantized_matmul(x, qw, names=names, implementation="pallas"))
    with jax.set_mesh(mesh):
      got = run(x, qw)
      jaxpr = str(jax.make_jaxpr(run)(x, qw))
    assert "shard_map" in jaxpr and ("psum" in jaxpr) == (names[0] is not None)
    if mode == "w8a8":
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))
    else:
      assert _relative(got, want) < 1e-5


def test_bad_arguments_name_the_argument():
  w = jnp.ones((96, 64))
  with pytest.raises(ValueError, match="group_size=48 must be one of"):
    quantize_weight(w, "int4", 48)
  with pytest.raises(ValueError, match="group_size=64 does not divide K=96"):
    quantize_weight(w, "int4", 64)
  with pytest.raises(ValueError, match="group_size=32 applies to mode='int4' only"):
    quantize_weight(w, "int8", 32)
  with pytest.raises(ValueError, match="mode='int3' is not one of"):
    quantize_weight(w, "int3")
  qw = quantize_weight(w, "int8")
  with pytest.raises(ValueError, match=r"x has 95 input features.*K=96"):
    pallas_kernels.quantized_matmul(jnp.ones((2, 95)), qw)
  with pytest.raises(ValueError, match="outlier_channels=2 needs mode='w8a8'"):
    pallas_kernels.quantized_matmul(jnp.ones((2, 96)), qw, outlier_channels=2)
  with pytest.raises(ValueError, match="implementation='mosaic' is not one of"):
    pallas_kernels.quantized_matmul(jnp.ones((2, 96)), qw, implementation="mosaic")
  with pytest.raises(ValueError, match=r"scales has shape \(2, 64\)"):
    pallas_kernels.quantized_matmul(jnp.ones((2, 96)), QuantizedWeight(qw.values, jnp.ones((2, 64))))
  with pytest.raises(ValueError, match="block_k=100 must be a positive multiple of 128"):
    quantized_matmul_tpu(jnp.ones((2, 96)), qw, blocks=MatmulBlocks(32, 128, 100))


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 64), ("w8a8", None)])
@pytest.mark.parametrize("splits", [2, 6])
def test_gpu_kernel_splits_k(mode, group, splits):
  """Split-K: programs that each sum a share of K, added after, give the reference's result
  (W8A8 bit for bit: its int32 partial sums add exactly before the scales)."""
  x, w = _inputs(5, 384, 136, jnp.float32)
  qw = quantize_weight(w, mode, group)
  run = functools.partial(quantized_matmul_gpu, blocks=MatmulBlocks(16, 64, 64), splits=splits, interpret=True)
  if mode == "w8a8":
    xq, xs = quantize.quantize_rows(x)
    np.testing.assert_array_equal(jax.jit(run)(xq, qw, xs), reference.w8a8_reference(xq, xs, qw))
    return
  assert _relative(jax.jit(run)(x, qw), reference.weight_only_reference(x, qw)) < TOLERANCE[jnp.float32]


def test_gpu_kernel_refuses_splits_that_do_not_divide_k():
  x, w = _inputs(5, 384, 136, jnp.float32)
  with pytest.raises(UserError, match="splits=4 must divide the 6 K steps"):
    quantized_matmul_gpu(x, quantize_weight(w, "int8"), blocks=MatmulBlocks(16, 64, 64), splits=4, interpret=True)
