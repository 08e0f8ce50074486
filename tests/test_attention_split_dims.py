"""Queries and keys with another head dim than the values (multi-head latent attention:
192 and 128): the flash kernels (TPU and GPU, interpret mode) and the chunked path against
the reference, forward and backward; the paged decode kernels reading values as the first
entries of each key (MLA's latent cache), with and without attention sinks, against the
reference; TPU compile and CUDA lowering of both."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels import AttentionSpec, BlockSizes
from jaxpar.pallas_kernels.attention.chunked import chunked_attention
from jaxpar.pallas_kernels.attention.decode_gpu import paged_decode_attention_gpu
from jaxpar.pallas_kernels.attention.decode_tpu import paged_decode_attention_tpu
from jaxpar.pallas_kernels.attention.flash_gpu import flash_attention_gpu
from jaxpar.pallas_kernels.attention.flash_tpu import flash_attention_tpu
from jaxpar.pallas_kernels.attention.reference import decode_attention_reference
from tests.test_attention import assert_matches_reference
from tests.test_attention_compile import _export_cuda, _topology_mesh, _train_grads


def split_inputs(q_len=200, heads=4, kv_heads=4, head_dim=192, value_dim=128, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (1, q_len, heads, head_dim), dtype)
  k = jax.random.normal(ks[1], (1, q_len, kv_heads, head_dim), dtype)
  v = jax.random.normal(ks[2], (1, q_len, kv_heads, value_dim), dtype)
  do = jax.random.normal(ks[3], (1, q_len, heads, value_dim), dtype)
  return q, k, v, do, None


KERNELS = {  # kernel, tiles
  "tpu": (flash_attention_tpu, BlockSizes(128, 128)),
  "gpu": (flash_attention_gpu, BlockSizes(64, 64, 32, 64)),
  "chunked": (chunked_attention, BlockSizes(128, 128)),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_split_head_dims_match_reference(kernel):
  """MLA's shape (192 / 128, every head its own key) with a scale that is not 1/sqrt(D),
  as YaRN's mscale makes it."""
  kernel, tiles = KERNELS[kernel]
  assert_matches_reference(kernel, *split_inputs(), tiles=tiles, causal=True, scale=0.09)


def test_split_head_dims_gqa_window():
  """Values wider than q/k (64 / 128), two query heads per kv head, a window across tiles."""
  kernel, tiles = KERNELS["tpu"]
  assert_matches_reference(kernel, *split_inputs(q_len=160, heads=4, kv_heads=2, head_dim=64), tiles=tiles,
                           causal=True, sliding_window=90)


def latent_inputs(batch=3, heads=8, latent=128, rope=64, page_size=16, pages_per_seq=6, num_pages=24):
  """Absorbed-form queries [B, H, latent + rope] and one latent page array [1, P, S, latent + rope]."""
  ks = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(ks[0], (batch, heads, latent + rope), jnp.float32)
  pages = jax.random.normal(ks[1], (1, num_pages, page_size, latent + rope), jnp.float32)
  table = jax.random.permutation(ks[2], num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq)
  return q, pages, jnp.array([37, 0, 96][:batch], jnp.int32), table.astype(jnp.int32)


@pytest.mark.parametrize("kernel", [paged_decode_attention_tpu, paged_decode_attention_gpu], ids=["tpu", "gpu"])
def test_latent_decode_kernels_match_reference(kernel):
  """Values read as the first 128 entries of each 192-entry latent key; also as their own
  pages of another head dim."""
  q, pages, lengths, table = latent_inputs()
  latent = AttentionSpec(value_dim=128, scale=0.07)
  want = decode_attention_reference(q, pages, None, lengths, latent, page_table=table)
  got = kernel(q, pages, None, lengths, table, latent.replace(interpret=True))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert got.shape == (3, 8, 128) and not np.any(got[1])
  v_pages = pages[..., :128] * 2.0
  window = AttentionSpec.of(sliding_window=30)
  want = decode_attention_reference(q, pages, v_pages, lengths, window, page_table=table)
  got = kernel(q, pages, v_pages, lengths, table, window.replace(interpret=True))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # Attention sinks (GPT-OSS) meet the latent cache: each query head's sink joins its row.
  sinks = jnp.linspace(-1.0, 3.0, 8)
  latent = AttentionSpec(value_dim=128)
  want = decode_attention_reference(q, pages, None, lengths, latent, page_table=table, sinks=sinks)
  got = kernel(q, pages, None, lengths, table, latent.replace(interpret=True), sinks=sinks)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_latent_decode_through_the_door_on_a_tensor_mesh():
  """The door splits the query heads over `tensor` and gives every device the one latent
  page array whole, and each device its own heads' sinks; prefill (several tokens) reads the
  same pages through the reference."""
  q, pages, lengths, table = latent_inputs(batch=4)
  lengths = jnp.array([37, 5, 96, 60], jnp.int32)
  # The batch stays whole: interpret mode cannot index per-device scalar-prefetched lengths
  # inside shard_map (compiled for TPU it can: test_split_dims_compile_for_tpu).
  mesh = jax.make_mesh((1, 8), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sinks = jnp.linspace(-1.0, 3.0, 8)  # a different sink per head: a misplaced one shows
  latent = AttentionSpec(value_dim=128)
  run = functools.partial(pallas_kernels.decode_attention, page_table=table, sinks=sinks)
  want = run(q, pages, None, lengths, latent.replace(implementation="reference"))
  with jax.set_mesh(mesh):  # the default rules: batch over data, heads over tensor
    got = jax.jit(lambda *a: run(*a, latent.replace(implementation="flash")))(q, pages, None, lengths)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  positions = lengths[:, None] - 3 + jnp.arange(3)
  chunk = pallas_kernels.paged_attention(jnp.repeat(q[:, None], 3, axis=1), pages, None, positions, table,
                                         latent, sinks=sinks)
  np.testing.assert_allclose(chunk[:, -1], want, atol=1e-5, rtol=1e-5)


@pytest.mark.tpu
def test_split_dims_compile_for_tpu():
  """MLA's training shapes (q/k 192, v 128) through the flash door, forward and backward,
  and the absorbed decode over one 576-wide latent page array (512 latent + 64 rope) with
  attention sinks, for a v5p slice: Mosaic accepts both."""
  mesh = _topology_mesh("v5p:2x2x1")
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  batch, length, heads = mesh.shape["data"], 1024, 4
  head_spec = P("data", None, "tensor")
  q, k = (sds((batch, length, heads, 192), jnp.bfloat16, head_spec) for _ in range(2))
  v = sds((batch, length, heads, 128), jnp.bfloat16, head_spec)
  with jax.set_mesh(mesh):
    train = lambda q, k, v: _train_grads(None)(q, k, v)
    assert jax.jit(train).lower(q, k, v).compile().as_text().count("tpu_custom_call") >= 3
    pages = sds((1, 64, 128, 576), jnp.bfloat16, P())
    decode = jax.jit(lambda q, k, n, t, s: pallas_kernels.decode_attention(q, k, None, n, AttentionSpec(value_dim=512),
                                                                           page_table=t, sinks=s))
    compiled = decode.lower(sds((batch, 16, 576), jnp.bfloat16, P("data", "tensor")), pages,
                            sds((batch,), jnp.int32, P("data")), sds((batch, 8), jnp.int32, P("data")),
                            sds((16,), jnp.float32, P("tensor"))).compile()
  assert "tpu_custom_call" in compiled.as_text()


def test_split_dims_lower_for_cuda():
  """The Triton flash kernels take 192 / 128 (192 runs zero-padded to 256), forward and
  backward; the Triton decode kernel reads a 576-wide latent as 512 + 64 pieces, sinks too."""
  q = jax.ShapeDtypeStruct((1, 256, 4, 192), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)

  def train(q, k, v):
    out, vjp = jax.vjp(flash_attention_gpu, q, k, v)
    return out, vjp(out)
  assert _export_cuda(train, q, q, v) == 3
  args = (jax.ShapeDtypeStruct((2, 16, 576), jnp.bfloat16), jax.ShapeDtypeStruct((1, 40, 16, 576), jnp.bfloat16),
          None, jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, 8), jnp.int32),
          jax.ShapeDtypeStruct((16,), jnp.float32))
  decode = lambda q, k, n, t, s: paged_decode_attention_gpu(q, k, None, n, t, AttentionSpec(value_dim=512), sinks=s)  # noqa: E731
  assert _export_cuda(decode, *args[:2], *args[3:]) == 1


@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_split_head_dims_under_context_parallelism(strategy):
  """Ring and all-gather attention over data 2 x context 4 (zig-zag order) with values of
  another head dim (24) than queries and keys (16), forward and backward."""
  from test_context_parallel import AXES, CONTEXT, _assert_close, _loss_and_grads
  q, k, v, _, _ = split_inputs(q_len=48, heads=4, kv_heads=2, head_dim=16, value_dim=24)
  q, k, v = (jnp.concatenate([x, x[::-1] * 0.5]) for x in (q, k, v))  # a batch of 2 for `data`
  mesh = jax.make_mesh((2, 1, 1, CONTEXT, 1, 1), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 6)

  def split(q, k, v):
    order = lambda x: pallas_kernels.zigzag(x, CONTEXT)  # noqa: E731
    spec = AttentionSpec(implementation="chunked", block_sizes=BlockSizes(8, 8))
    out = pallas_kernels.attention(order(q), order(k), order(v), spec, context_parallel=strategy, zigzag=True)
    return pallas_kernels.unzigzag(out, CONTEXT)

  with jax.set_mesh(mesh):
    got = jax.jit(lambda q, k, v: _loss_and_grads(split, q, k, v))(q, k, v)
  _assert_close(got, _loss_and_grads(pallas_kernels.attention_reference, q, k, v))
