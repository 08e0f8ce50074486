"""The roofline (jaxpar/aot/roofline.py) on programs whose cost is known by hand: a scanned
matmul loop and a Pallas kernel with a cost estimate, compiled by libtpu; and the padded
window convolutions TPU HLO writes for per-head projections."""


import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from jaxpar.aot import hlo, roofline
from jaxpar.aot.chips import topology_devices

TRIPS, ROWS, WIDTH = 4, 256, 512
KERNEL = pl.CostEstimate(flops=1000, transcendentals=0, bytes_accessed=5000)


def _program(x, weights):
  def layer(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype), None
  x, _ = jax.lax.scan(layer, x, weights)

  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2
  return pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                        cost_estimate=KERNEL)(x)


@pytest.mark.tpu
def test_roofline_counts_every_loop_trip_and_the_kernel_estimate():
  _, devices = topology_devices("v5e-4")
  on_chip = jax.sharding.SingleDeviceSharding(devices[0])
  x = jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.bfloat16, sharding=on_chip)
  weights = jax.ShapeDtypeStruct((TRIPS, WIDTH, WIDTH), jnp.bfloat16, sharding=on_chip)
  compiled = jax.jit(_program).lower(x, weights).compile()
  cost = roofline.program_cost(hlo.Module(compiled.as_text()), peak_flops=1e12, hbm_bandwidth=1e9)

  matmuls = TRIPS * 2 * ROWS * WIDTH * WIDTH
  assert cost.flops == matmuls + KERNEL.flops
  # The compiler's own count sees one trip of the loop: the pitfall this module avoids.
  assert compiled.cost_analysis()["flops"] < matmuls / 2
  # Each trip reads its own layer's weights from HBM (not the whole stack) and the kernel
  # moves what its estimate says; the activations move at most in and out once per trip.
  weight_slices = TRIPS * WIDTH * WIDTH * 2
  activations = ROWS * WIDTH * 2
  assert weight_slices + KERNEL.bytes_accessed <= cost.bytes
  assert cost.bytes <= weight_slices + KERNEL.bytes_accessed + 2 * (TRIPS + 1) * activations
  # Each op at its own roofline: between the slower of the two totals and their sum.
  assert max(cost.bytes / 1e9, cost.flops / 1e12) <= cost.ops_s <= cost.bytes / 1e9 + cost.flops / 1e12


CONVOLUTIONS = """HloModule m

ENTRY %main (x: bf16[3,8192,4096,1], w: bf16[32,128,4096,1]) -> bf16[3,8192,32,128] {
  %x = bf16[3,8192,4096,1]{1,2,3,0} parameter(0)
  %w = bf16[32,128,4096,1]{1,2,0,3} parameter(1)
  ROOT %q = bf16[3,8192,32,128]{3,1,2,0} convolution(%x, %w), \
window={size=1x32 pad=0_0x31_31 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}
"""


def test_a_head_axis_written_as_a_padded_window_counts_only_real_taps():
  # q = x @ Wq for 3 x 8192 tokens, 4096 -> 32 heads x 128: XLA writes the head axis as a
  # window of 32 taps padded by 31 each side; only one tap per output meets real input.
  module = hlo.Module(CONVOLUTIONS)
  q = next(i for i in module.computations[module.entry] if i.op == "convolution")
  assert roofline.matmul_flops(module, q) == 2 * 3 * 8192 * 4096 * 32 * 128


@pytest.mark.tpu
def test_a_cache_written_in_place_by_scatter_counts_only_the_rows_written():
  """A KV cache updated at a few rows (scatter into a donated buffer, as each decode step
  writes its new tokens) costs those rows, not the whole cache."""
  _, devices = topology_devices("v5e-4")
  on_chip = jax.sharding.SingleDeviceSharding(devices[0])
  cache = jax.ShapeDtypeStruct((4096, 8, 128), jnp.bfloat16, sharding=on_chip)
  rows = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=on_chip)
  new = jax.ShapeDtypeStruct((8, 8, 128), jnp.bfloat16, sharding=on_chip)
  write = jax.jit(lambda cache, rows, new: cache.at[rows].set(new, mode="drop"), donate_argnums=0)
  cost = roofline.program_cost(hlo.Module(write.lower(cache, rows, new).compile().as_text()), 1e12, 1e9)
  whole = 4096 * 8 * 128 * 2
  assert 8 * 8 * 128 * 2 <= cost.bytes < whole / 16


def test_a_scalar_copied_to_host_memory_counts_its_own_bytes():
  """An optimizer's step count moved to pinned host memory (a 4-byte copy-start, whose context
  is a 4-byte scalar too) counts 4 bytes; it crashed the estimate when scalars were dropped."""
  scalar = hlo.Instruction("copy-start.1", "(s32[]{:S(5)}, s32[], u32[])", "copy-start", ["count"], "count", "")
  array = hlo.Instruction("copy-start.2", "(f32[8,128]{1,0:S(5)}, f32[8,128]{1,0}, u32[])", "copy-start",
                          ["mu"], "mu", "")
  assert roofline.host_transfer_bytes(scalar) == 4
  assert roofline.host_transfer_bytes(array) == 8 * 128 * 4


@pytest.mark.tpu
def test_an_int8_matmul_runs_at_the_int8_peak_and_a_bf16_one_at_the_bf16_peak():
  """s8 x s8 dots (train_precision int8) cost their FLOPs over the chip's int8 rate; with
  memory free (a huge bandwidth), doubling that rate halves their time and leaves bf16's."""
  _, devices = topology_devices("v5e-4")
  on_chip = jax.sharding.SingleDeviceSharding(devices[0])
  times = {}
  for dtype, out in ((jnp.int8, jnp.int32), (jnp.bfloat16, jnp.float32)):
    a = jax.ShapeDtypeStruct((1024, 2048), dtype, sharding=on_chip)
    b = jax.ShapeDtypeStruct((2048, 512), dtype, sharding=on_chip)
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=out))
    module = hlo.Module(matmul.lower(a, b).compile().as_text())
    times[dtype] = [roofline.program_cost(module, 1e12, 1e18, int8_flops=rate) for rate in (None, 2e12)]
  flops = 2 * 1024 * 2048 * 512
  int8, bf16 = times[jnp.int8], times[jnp.bfloat16]
  assert int8[0].flops == bf16[0].flops == flops
  assert int8[0].ops_s == pytest.approx(flops / 1e12, rel=1e-3)
  assert int8[1].ops_s == pytest.approx(flops / 2e12, rel=1e-3)
  assert bf16[1].ops_s == bf16[0].ops_s == pytest.approx(flops / 1e12, rel=1e-3)
