"""Attention sinks (GPT-OSS: one learned logit per query head in every row's softmax, with
a zero value) through the reference, every kernel (flash TPU and GPU in interpret mode,
chunked, paged decode TPU and GPU), ring and all-gather context parallelism, forward and
backward (the sinks' own gradient included); they compile for TPU and lower for CUDA."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import pallas_kernels
from jaxpar.errors import UserError
from jaxpar.pallas_kernels import AttentionSpec, BlockSizes, attention_reference
from jaxpar.pallas_kernels.attention.chunked import chunked_attention
from jaxpar.pallas_kernels.attention.decode_gpu import paged_decode_attention_gpu
from jaxpar.pallas_kernels.attention.decode_tpu import paged_decode_attention_tpu
from jaxpar.pallas_kernels.attention.flash_gpu import flash_attention_gpu
from jaxpar.pallas_kernels.attention.flash_tpu import flash_attention_tpu
from jaxpar.pallas_kernels.attention.reference import decode_attention_reference, gather_pages
from tests.test_attention_compile import _export_cuda, _topology_mesh
from tests.test_decode_attention import paged_inputs

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


def _inputs(length=200, num_heads=4, num_kv_heads=2, head_dim=64, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (2, length, num_heads, head_dim))
  k = jax.random.normal(ks[1], (2, length, num_kv_heads, head_dim))
  v = jax.random.normal(ks[2], (2, length, num_kv_heads, head_dim))
  # Sinks around the rows' own log-sum-exp (~log of the keys seen), so they take a real share.
  sinks = jnp.array([0.5, 2.0, 4.0, -1.0][:num_heads]) + jnp.arange(num_heads) * 0.1
  return q, k, v, sinks


def _loss_and_grads(attend, q, k, v, sinks):
  loss = lambda q, k, v, s: jnp.sum(jnp.sin(attend(q, k, v, s)))
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)


def _assert_close(got, want, tol=1e-4):
  for name, a, b in zip(("loss", "dq", "dk", "dv", "dsinks"), jax.tree.leaves(got), jax.tree.leaves(want)):
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    assert err < tol, f"{name}: relative error {err:.1e}"


def test_reference_sink_is_one_more_key_with_zero_value():
  """One key: o = v * sigmoid(s - sink); a very negative sink is no sink."""
  q, k, v, sinks = _inputs(length=1, num_heads=2, num_kv_heads=1)
  got = attention_reference(q, k, v, sinks=sinks[:2])
  logit = jnp.einsum("bqhd,bkd->bhqk", q, k[:, :, 0]) * q.shape[-1] ** -0.5  # [B, H, 1, 1]
  weight = jax.nn.sigmoid(logit[..., 0, 0] - sinks[:2])  # [B, H]
  np.testing.assert_allclose(got[:, 0], weight[..., None] * v[:, 0], rtol=1e-5, atol=1e-6)
  q, k, v, _ = _inputs(length=16)
  np.testing.assert_allclose(attention_reference(q, k, v, sinks=jnp.full((4,), -1e30)),
                             attention_reference(q, k, v), rtol=1e-6)


KERNELS = {  # kernel, tiles (run in interpret mode)
    "tpu": (flash_attention_tpu, BlockSizes(128, 128)),
    "gpu": (flash_attention_gpu, BlockSizes(64, 64)),
    "chunked": (chunked_attention, BlockSizes(64, 64)),
}
OPTIONS = [AttentionSpec.of(causal=True), AttentionSpec.of(causal=True, sliding_window=50, logit_soft_cap=20.0)]


@pytest.mark.parametrize("spec", OPTIONS, ids=["causal", "window_softcap"])
@pytest.mark.parametrize("kernel", KERNELS, ids=list(KERNELS))
def test_kernels_with_sinks_match_reference(kernel, spec):
  """200 tokens (not a tile multiple), GQA 2, forward and all four gradients."""
  q, k, v, sinks = _inputs()
  kernel, tiles = KERNELS[kernel]
  run = lambda q, k, v, s: kernel(q, k, v, spec.replace(block_sizes=tiles, interpret=True), sinks=s)
  got = jax.jit(lambda *a: _loss_and_grads(run, *a))(q, k, v, sinks)
  want = _loss_and_grads(lambda q, k, v, s: attention_reference(q, k, v, spec, sinks=s), q, k, v, sinks)
  _assert_close(got, want)
  without = _loss_and_grads(lambda q, k, v, s: attention_reference(q, k, v, spec), q, k, v, sinks)
  assert abs(float(without[0] - want[0])) > 1e-2 * abs(float(want[0])), "the sinks change the output"


@pytest.mark.parametrize("kernel", [paged_decode_attention_tpu, paged_decode_attention_gpu], ids=["tpu", "gpu"])
def test_paged_decode_kernels_with_sinks(kernel):
  q, k, v, lengths, table = paged_inputs(num_heads=8)
  sinks = jnp.linspace(-2.0, 3.0, 8)
  for spec in (AttentionSpec(), AttentionSpec.of(sliding_window=20, logit_soft_cap=5.0)):
    got = kernel(q, k, v, lengths, table, spec.replace(interpret=True), sinks=sinks)
    want = decode_attention_reference(q, k, v, lengths, spec, page_table=table, sinks=sinks)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # A decode step is the last row of the training attention over the same keys.
  n = int(lengths[0])
  k_seq, v_seq = (gather_pages(x, table)[:1, :n] for x in (k, v))
  full = attention_reference(q[:1, None], k_seq, v_seq, sinks=sinks)
  step = decode_attention_reference(q, k, v, lengths, page_table=table, sinks=sinks)
  np.testing.assert_allclose(step[:1], full[:, 0], atol=1e-5)


@pytest.mark.parametrize("strategy,zigzag", [("ring", True), ("all_gather", False)])
def test_context_parallel_with_sinks(strategy, zigzag):
  """Length split 4 ways and heads 2 ways (the sinks split with the heads)."""
  mesh = jax.make_mesh((1, 1, 1, 4, 1, 2), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 6)
  q, k, v, sinks = _inputs(length=96, head_dim=16)
  order = (lambda x: pallas_kernels.zigzag(x, 4)) if zigzag else (lambda x: x)
  back = (lambda x: pallas_kernels.unzigzag(x, 4)) if zigzag else (lambda x: x)

  window = AttentionSpec.of(sliding_window=40)
  tiled = window.replace(implementation="chunked", block_sizes=BlockSizes(8, 8))

  def split(q, k, v, s):
    return back(pallas_kernels.attention(order(q), order(k), order(v), tiled, sinks=s,
                                         context_parallel=strategy, zigzag=zigzag))

  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: _loss_and_grads(split, *a))(q, k, v, sinks)
  want = _loss_and_grads(lambda q, k, v, s: attention_reference(q, k, v, window, sinks=s), q, k, v, sinks)
  _assert_close(got, want)


def test_flash_door_on_a_mesh_with_sinks():
  """Batch over data, heads (and sinks) over tensor: each device's sink gradient is a partial
  sum over its rows, summed across the batch devices."""
  mesh = jax.make_mesh((2, 1, 1, 1, 1, 2), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 6)
  q, k, v, sinks = _inputs(length=128)
  spec = AttentionSpec(implementation="flash", block_sizes=BlockSizes(128, 128))
  run = lambda q, k, v, s: pallas_kernels.attention(q, k, v, spec, sinks=s)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: _loss_and_grads(run, *a))(q, k, v, sinks)
  _assert_close(got, _loss_and_grads(lambda q, k, v, s: attention_reference(q, k, v, sinks=s), q, k, v, sinks))


def test_sinks_of_the_wrong_shape_are_a_one_line_error():
  q, k, v, _ = _inputs(length=8)
  with pytest.raises(UserError, match=r"sinks must be \[q heads\] = \(4,\)"):
    pallas_kernels.attention(q, k, v, AttentionSpec(implementation="reference"), sinks=jnp.zeros((2,)))


@pytest.mark.tpu
def test_tpu_kernels_with_sinks_compile():
  mesh = _topology_mesh("v5e:2x2")
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
  batch, heads = mesh.shape["data"], P("data", None, "tensor")
  q = sds((batch, 1024, 8, 64), jnp.bfloat16, heads)
  kv = sds((batch, 1024, 2, 64), jnp.bfloat16, heads)
  sinks = sds((8,), jnp.float32, P("tensor"))

  def train(q, k, v, s):
    spec = AttentionSpec.of(sliding_window=128, implementation="flash")
    loss = lambda *a: jnp.sum(pallas_kernels.attention(*a[:3], spec, sinks=a[3]).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, s)

  with jax.set_mesh(mesh):
    assert jax.jit(train).lower(q, kv, kv, sinks).compile().as_text().count("tpu_custom_call") >= 3
    pages = sds((2, 32, 16, 64), jnp.bfloat16, P("tensor"))
    decode = jax.jit(lambda q, k, v, n, t, s: pallas_kernels.decode_attention(q, k, v, n, page_table=t, sinks=s))
    compiled = decode.lower(sds((batch, 8, 64), jnp.bfloat16, P("data", "tensor")), pages, pages,
                            sds((batch,), jnp.int32, P("data")), sds((batch, 8), jnp.int32, P("data")),
                            sinks).compile()
    assert "tpu_custom_call" in compiled.as_text()


def test_gpu_kernels_with_sinks_lower_for_cuda():
  q = jax.ShapeDtypeStruct((2, 256, 8, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
  sinks = jax.ShapeDtypeStruct((8,), jnp.float32)

  def train(q, k, v, s):
    out, vjp = jax.vjp(lambda *a: flash_attention_gpu(*a[:3], AttentionSpec.of(sliding_window=100), sinks=a[3]), q, k, v, s)
    return out, vjp(out)

  assert _export_cuda(train, q, kv, kv, sinks) == 3  # forward, dK/dV and dQ kernels
  pages = jax.ShapeDtypeStruct((2, 40, 16, 64), jnp.bfloat16)
  args = (jax.ShapeDtypeStruct((4, 8, 64), jnp.bfloat16), pages, pages,
          jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((4, 8), jnp.int32), sinks)
  assert _export_cuda(lambda *a: paged_decode_attention_gpu(*a[:5], sinks=a[5]), *args) == 1
