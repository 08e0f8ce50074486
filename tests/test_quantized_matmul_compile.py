"""The quantized matmul kernels compile for real TPU chips (libtpu: v5e and v6e, inside
shard_map with tensor-parallel weights) and lower for CUDA (Triton) through jax.export,
forward only, without hardware."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels import QuantizedWeight, quantize_weight
from jaxpar.pallas_kernels.matmul.gpu import quantized_matmul_gpu

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")
MODES = [("int8", None, False), ("int4", 128, True), ("int4", 32, False), ("w8a8", None, False)]


def _abstract_weight(k, n, mode, group, zero_point):
  return jax.eval_shape(lambda: quantize_weight(jnp.zeros((k, n)), mode, group, zero_point=zero_point))


@pytest.mark.tpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_tpu_kernels_compile_tensor_parallel(topology):
  """Batch over data, weights split over tensor: the MLP's column-parallel up projection and
  row-parallel down projection (partial products summed across tensor) in one program."""
  from jax.experimental import topologies
  devices = np.array(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)
  mesh = jax.sharding.Mesh(devices.reshape(2, 1, 1, 1, 1, 2), AXES, axis_types=(AxisType.Auto,) * 6)
  embed, mlp = 1024, 2048

  def sharded(tree, spec):  # per-channel scales [1, N] keep only the N split
    one = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, spec if a.shape[0] > 1 else P(None, spec[1])))
    return jax.tree.map(one, tree)

  for mode, group, zero_point in MODES:
    up = sharded(_abstract_weight(embed, mlp, mode, group, zero_point), P(None, "tensor"))
    down = sharded(_abstract_weight(mlp, embed, mode, group, zero_point), P("tensor", None))
    x = jax.ShapeDtypeStruct((16, embed), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))

    def mlp_block(x, up, down):
      h = pallas_kernels.quantized_matmul(x, up, names=(None, "act_mlp"))
      return pallas_kernels.quantized_matmul(jax.nn.silu(h), down, names=("act_mlp", None))

    with jax.set_mesh(mesh):
      hlo = jax.jit(mlp_block).lower(x, up, down).compile().as_text()
    assert hlo.count("tpu_custom_call") == 2, mode
    assert "all-reduce" in hlo, mode  # the row-parallel partial sums


@pytest.mark.parametrize("mode,group,zero_point", MODES, ids=[f"{m}-{g}" for m, g, _ in MODES])
def test_gpu_kernels_lower_for_cuda(mode, group, zero_point):
  w = _abstract_weight(1024, 512, mode, group, zero_point)
  x = jax.ShapeDtypeStruct((8, 1024), jnp.int8 if mode == "w8a8" else jnp.bfloat16)
  x_scales = jax.ShapeDtypeStruct((8, 1), jnp.float32) if mode == "w8a8" else None

  def run(x, values, scales, zeros, x_scales):
    return quantized_matmul_gpu(x, QuantizedWeight(values, scales, zeros, mode=mode, group_size=group),
                                x_scales)

  triton = "__gpu$xla.gpu.triton"
  exported = jax.export.export(jax.jit(run), platforms=["cuda"],
                               disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])
  module = exported(x, w.values, w.scales, w.zeros, x_scales).mlir_module()
  assert module.count(triton) == 1


@pytest.mark.tpu
def test_tpu_quantized_model_forward_compiles():
  """A whole int4 model (QuantizedKernel projections, logical names -> shard_map specs) on
  v6e, fsdp 2 x tensor 2: every projection of the scanned layer is a Mosaic kernel."""
  from jax.experimental import topologies

  from jaxpar.runtime import Runtime
  from tests.helpers import small_config
  config = small_config(model={"head_dim": 32, "quantization": {"mode": "int4", "group_size": 32}},
                        mesh={"fsdp": 2, "tensor": 2})
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v6e:2x2").devices
  runtime = Runtime(config.model, config.mesh, devices)
  params = runtime.abstract_targets()[0]
  tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32, sharding=NamedSharding(runtime.mesh, P(("data", "fsdp"))))
  with runtime.context():
    hlo = jax.jit(lambda p, t: runtime.merge(p)(t)[0]).lower(params, tokens).compile().as_text()
  assert hlo.count("quantized_matmul_int4") >= 7  # q, k, v, o, gate, up, down
