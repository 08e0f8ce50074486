"""The kernels compile for real TPU chips (libtpu, inside shard_map on a multi-device
topology mesh) and lower for CUDA (Triton), forward and backward, without hardware."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels import AttentionSpec
from jaxpar.pallas_kernels.attention.decode_gpu import paged_decode_attention_gpu
from jaxpar.pallas_kernels.attention.flash_gpu import flash_attention_gpu

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


def _topology_mesh(name):
  from jax.experimental import topologies
  devices = np.array(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
  shape = (devices.size // 2, 1, 1, 1, 1, 2)  # batch over data, heads over tensor
  return jax.sharding.Mesh(devices.reshape(shape), AXES, axis_types=(AxisType.Auto,) * 6)


def _train_grads(seg, **options):
  spec = AttentionSpec.of(implementation="flash", **options)

  def loss(q, k, v):
    out = pallas_kernels.attention(q, k, v, spec, segment_ids=seg)
    return jnp.sum(out.astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


@pytest.mark.tpu
@pytest.mark.parametrize("topology,head_dim,group", [
    ("v5e:2x2", 128, 4), ("v5p:2x2x1", 128, 4), ("v6e:2x2", 128, 4),
    # The largest tiles: head_dim 256 x 8 query heads per kv head, on the smaller VMEMs.
    pytest.param("v5e:2x2", 256, 8, marks=pytest.mark.slow),
    pytest.param("v5p:2x2x1", 256, 8, marks=pytest.mark.slow),
    # Gemma 4's 512-wide global heads, 8 per kv head, on v5p's 64 MiB (its own 256-row query tiles).
    ("v5p:2x2x1", 512, 8)])
def test_tpu_flash_and_decode_compile(topology, head_dim, group):
  mesh = _topology_mesh(topology)
  batch, length, kv_heads = mesh.shape["data"], 2048, 2
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype,
                                                        sharding=NamedSharding(mesh, spec))
  heads = P("data", None, "tensor")
  q = sds((batch, length, kv_heads * group, head_dim), jnp.bfloat16, heads)
  kv = sds((batch, length, kv_heads, head_dim), jnp.bfloat16, heads)
  seg = sds((batch, length), jnp.int32, P("data"))
  with jax.set_mesh(mesh):
    train = lambda q, k, v, s: _train_grads(s, sliding_window=1024, logit_soft_cap=50.0)(q, k, v)
    compiled = jax.jit(train).lower(q, kv, kv, seg).compile()
    hlo = compiled.as_text()
    assert hlo.count("tpu_custom_call") >= 3  # forward, dK/dV and dQ kernels
    pages = sds((kv_heads, 64, 128, head_dim), jnp.bfloat16, P("tensor"))
    decode = jax.jit(lambda q, k, v, n, t: pallas_kernels.decode_attention(q, k, v, n, page_table=t))
    compiled = decode.lower(sds((batch, kv_heads * group, head_dim), jnp.bfloat16, P("data", "tensor")),
                            pages, pages, sds((batch,), jnp.int32, P("data")),
                            sds((batch, 8), jnp.int32, P("data"))).compile()
    assert "tpu_custom_call" in compiled.as_text()


def _export_cuda(fn, *args):
  triton = "__gpu$xla.gpu.triton"
  exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                               disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)])
  return exported(*args).mlir_module().count(triton)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_flash_lowers_for_cuda(head_dim):
  q = jax.ShapeDtypeStruct((2, 384, 8, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 384, 2, head_dim), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((2, 384), jnp.int32)

  def train(q, k, v, seg):
    spec = AttentionSpec.of(sliding_window=100, logit_soft_cap=30.0)
    run = lambda q, k, v: flash_attention_gpu(q, k, v, spec, segment_ids=seg)
    out, vjp = jax.vjp(run, q, k, v)
    return out, vjp(out)

  assert _export_cuda(train, q, kv, kv, seg) == 3  # forward, dK/dV and dQ kernels


def test_gpu_decode_lowers_for_cuda():
  pages = jax.ShapeDtypeStruct((4, 40, 16, 128), jnp.bfloat16)
  args = (jax.ShapeDtypeStruct((4, 16, 128), jnp.bfloat16), pages, pages,
          jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 8), jnp.int32))
  assert _export_cuda(lambda *a: paged_decode_attention_gpu(*a, AttentionSpec.of(sliding_window=64)), *args) == 1
  stacked = jax.ShapeDtypeStruct((6, 4, 40, 16, 128), jnp.bfloat16)  # 6 layers: one read by index
  layer_args = (args[0], stacked, stacked, *args[3:], jax.ShapeDtypeStruct((), jnp.int32))
  assert _export_cuda(lambda q, k, v, n, t, i: paged_decode_attention_gpu(q, k, v, n, t, layer=i),
                      *layer_args) == 1


@pytest.mark.tpu
def test_tpu_paged_decode_reads_its_layer_of_the_stacked_cache_in_place():
  """Through the door with the engine's stacked cache and a layer index, the TPU decode
  kernel fetches that layer's pages from the stack: no copy of the layer's pages (8 MiB per
  device here; a real server's pool is gigabytes) before the kernel, as slicing the layer
  out first made (a dynamic-slice fusion for k and for v)."""
  mesh = _topology_mesh("v5e:2x2")
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  batch = mesh.shape["data"]
  pool = sds((8, 2, 2048, 16, 128), jnp.bfloat16, P(None, "tensor"))
  with jax.set_mesh(mesh):
    decode = jax.jit(lambda q, k, v, t, p, i: pallas_kernels.paged_attention(q, k, v, p, t, layer=i))
    compiled = decode.lower(sds((batch, 1, 8, 128), jnp.bfloat16, P("data", None, "tensor")), pool, pool,
                            sds((batch, 64), jnp.int32, P("data")), sds((batch, 1), jnp.int32, P("data")),
                            jax.ShapeDtypeStruct((), jnp.int32)).compile()
  hlo = compiled.as_text()
  assert "tpu_custom_call" in hlo and "dynamic-slice" not in hlo


@pytest.mark.tpu
def test_tpu_windowed_paged_decode_compiles_on_the_window_pages():
  """Through the door with a sliding window, the TPU decode kernel's grid walks only the
  pages the window spans (3 of a 16-page table), not the whole table."""
  mesh = _topology_mesh("v5e:2x2")
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  batch = mesh.shape["data"]
  pages = sds((2, 64, 128, 128), jnp.bfloat16, P("tensor"))
  with jax.set_mesh(mesh):
    window = AttentionSpec.of(sliding_window=256)
    decode = jax.jit(lambda q, k, v, n, t: pallas_kernels.decode_attention(q, k, v, n, window, page_table=t))
    compiled = decode.lower(sds((batch, 8, 128), jnp.bfloat16, P("data", "tensor")), pages, pages,
                            sds((batch,), jnp.int32, P("data")),
                            sds((batch, 16), jnp.int32, P("data"))).compile()
  hlo = compiled.as_text()
  assert "tpu_custom_call" in hlo
  assert "s32[1,3]" in hlo or "s32[3]" in hlo, "the kernel's page table is the window's 3 pages"
