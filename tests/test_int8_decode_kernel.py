"""The TPU decode kernel over an int8 paged cache as stored (codes and per-token scales
read into VMEM, the scales applied to scores and probabilities, each row's partial page from
its float tail) equals XLA's path, which dequantizes the visible pages first; on a TPU it
compiles to a step that reads the pool in place."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.models import kv_cache_quantized, kv_quant
from jaxpar.pallas_kernels import AttentionSpec, reads_int8_pages

LAYERS, KV_HEADS, HEADS, HEAD_DIM, PAGE, PAGES, ROWS = 2, 2, 4, 32, 16, 16, 3
PREFILLED = np.array([37, 47, 20])  # decoding at these positions: a partial page, one it fills, another partial


def _filled_cache(rng, layer):
  cfg = SimpleNamespace(num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
  spec = kv_quant.KVQuantization("int8", page_size=PAGE, window=0)
  pool = kv_cache_quantized.init(cfg, LAYERS, PAGES, PAGE, ROWS, spec, jnp.float32)
  table = jnp.asarray(np.arange(ROWS * 5).reshape(ROWS, 5), jnp.int32)
  cache = kv_cache_quantized.QuantizedPagedCache(pool, table, jnp.arange(ROWS, dtype=jnp.int32),
                                                 jnp.asarray(layer, jnp.int32), spec)
  length = int(PREFILLED.max())
  positions = jnp.asarray(np.where(np.arange(length) < PREFILLED[:, None], np.arange(length), -1), jnp.int32)
  k, v = (jnp.asarray(rng.normal(size=(ROWS, length, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
  q = jnp.asarray(rng.normal(size=(ROWS, length, HEADS, HEAD_DIM)), jnp.float32)
  _, cache = cache.update_and_attend(q, k, v, SimpleNamespace(positions=positions),
                                     AttentionSpec(implementation="reference"))
  return cache


@pytest.mark.parametrize("window, sinks, layer", [(None, False, 1), (24, True, 0)], ids=["causal", "window-sinks"])
def test_the_int8_kernel_equals_dequantizing_first(window, sinks, layer):
  rng = np.random.default_rng(0)
  cache = _filled_cache(rng, layer)
  q = jnp.asarray(rng.normal(size=(ROWS, 1, HEADS, HEAD_DIM)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(ROWS, 1, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
  context = SimpleNamespace(positions=jnp.asarray(PREFILLED[:, None], jnp.int32))
  sink_logits = jnp.asarray(rng.normal(size=(HEADS,)), jnp.float32) if sinks else None
  outputs = {}
  for implementation in ("reference", "flash"):  # "flash" on CPU: the TPU kernel, interpreted
    spec = AttentionSpec.of(sliding_window=window, implementation=implementation)
    assert reads_int8_pages(spec) == (implementation == "flash")
    outputs[implementation] = jax.jit(lambda c, q, k, v, s, spec=spec: c.update_and_attend(
        q, k, v, context, spec, sinks=s))(cache, q, k, v, sink_logits)
  (want, want_cache), (got, got_cache) = outputs["reference"], outputs["flash"]
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):  # the same write
    np.testing.assert_array_equal(a, b)
  # Row 1's token filled its page: that page was read quantized; rows 0 and 2 read their tails.
  assert int(PREFILLED[1] + 1) % PAGE == 0 and all(int(n + 1) % PAGE for n in PREFILLED[[0, 2]])


@pytest.mark.tpu
def test_on_a_tpu_the_kernel_reads_the_int8_pool_in_place():
  """Compiled for v5e (libtpu on this host) through the cache's own decode step: with "auto"
  the int8 kernel reads the pool as written, where dequantizing first (the reference path)
  slices the layer's codes out of the pool for XLA's gather and dequantize."""
  from jax.experimental import topologies
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  devices = np.array(topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices)
  mesh = jax.sharding.Mesh(devices.reshape(2, 1, 1, 1, 1, 2), ("data", "stage", "fsdp", "context", "expert", "tensor"),
                           axis_types=(AxisType.Auto,) * 6)
  sds = lambda shape, dtype, spec=P(): jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
  layers, heads, pages, page, dim, rows, per_row = 4, 8, 1024, 16, 128, 8, 64
  pool = {"k": {"q": sds((layers, heads, pages, page, dim), jnp.int8, P(None, "tensor")),
                "scale": sds((layers, heads, pages, 1, page), jnp.bfloat16, P(None, "tensor"))},
          "tail_k": sds((layers, heads, rows, page, dim), jnp.bfloat16, P(None, "tensor"))}
  pool["v"], pool["tail_v"] = pool["k"], pool["tail_k"]
  spec_q = kv_quant.KVQuantization("int8", page_size=page, window=0)
  q = sds((rows, 1, 2 * heads, dim), jnp.bfloat16, P("data", None, "tensor"))
  k = sds((rows, 1, heads, dim), jnp.bfloat16, P("data", None, "tensor"))
  one_layer = f"s8[{heads // 2},{pages},{page},{dim}]"  # a layer of the pool on one device
  for implementation in ("auto", "reference"):
    def step(pool, table, slots, positions, q, k, v, spec=AttentionSpec(implementation=implementation)):
      cache = kv_cache_quantized.QuantizedPagedCache(pool, table, slots, jnp.int32(2), spec_q)
      out, cache = cache.update_and_attend(q, k, v, SimpleNamespace(positions=positions), spec)
      return out, cache.pages
    with jax.set_mesh(mesh):  # the pool donated and returned, as the engine runs: written in place
      compiled = jax.jit(step, donate_argnums=0).lower(
          pool, sds((rows, per_row), jnp.int32, P("data")), sds((rows,), jnp.int32, P("data")),
          sds((rows, 1), jnp.int32, P("data")), q, k, k).compile()
    hlo = compiled.as_text()
    kernel = implementation == "auto"
    assert ("paged_decode_attention_int8" in hlo) == kernel
    assert (one_layer in hlo) != kernel, implementation
    assert compiled.memory_analysis().temp_size_in_bytes < 2 ** 20  # nothing pool-sized besides
