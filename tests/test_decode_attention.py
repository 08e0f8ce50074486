"""Paged decode kernels (TPU and GPU, interpret mode) and the dispatch against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels import AttentionSpec
from jaxpar.pallas_kernels.attention.decode_gpu import paged_decode_attention_gpu
from jaxpar.pallas_kernels.attention.decode_tpu import paged_decode_attention_tpu
from jaxpar.pallas_kernels.attention.reference import decode_attention_reference, gather_pages


def paged_inputs(batch=3, num_heads=8, num_kv_heads=2, head_dim=128, page_size=16,
                 pages_per_seq=6, num_pages=24, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(ks[0], (batch, num_heads, head_dim), dtype)
  pages = (num_kv_heads, num_pages, page_size, head_dim)
  k = jax.random.normal(ks[1], pages, dtype)
  v = jax.random.normal(ks[2], pages, dtype)
  table = jax.random.permutation(ks[3], num_pages)[:batch * pages_per_seq]
  lengths = jnp.array([37, 0, 96, 1, 50, 17][:batch], jnp.int32)  # ragged, one empty
  return q, k, v, lengths, table.reshape(batch, pages_per_seq).astype(jnp.int32)


OPTIONS = [AttentionSpec(), AttentionSpec.of(sliding_window=20, logit_soft_cap=5.0)]
KERNELS = [paged_decode_attention_tpu, paged_decode_attention_gpu]
INTERPRET = AttentionSpec(interpret=True)


@pytest.mark.parametrize("spec", OPTIONS, ids=["plain", "window_softcap"])
@pytest.mark.parametrize("kernel", KERNELS, ids=["tpu", "gpu"])
@pytest.mark.parametrize("group", [1, 4])
def test_paged_kernel_interpret(kernel, spec, group):
  q, k, v, lengths, table = paged_inputs(num_heads=2 * group)
  got = kernel(q, k, v, lengths, table, spec.replace(interpret=True))
  want = decode_attention_reference(q, k, v, lengths, spec, page_table=table)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert not np.any(got[1]), "an empty sequence attends to nothing"


@pytest.mark.parametrize("kernel", KERNELS, ids=["tpu", "gpu"])
def test_paged_kernel_reads_one_layer_of_a_stacked_pool(kernel):
  """With `layer`, a kernel reads that layer of pages stacked over layers (the others hold
  NaN here: reading them would show), as the engine's stacked cache passes them."""
  q, k, v, lengths, table = paged_inputs(num_heads=4)
  stack = lambda x: jnp.full((3, *x.shape), jnp.nan, x.dtype).at[2].set(x)  # noqa: E731
  got = kernel(q, stack(k), stack(v), lengths, table, INTERPRET, layer=jnp.int32(2))
  want = decode_attention_reference(q, k, v, lengths, page_table=table)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_paged_kernel_bf16():
  q, k, v, lengths, table = paged_inputs(dtype=jnp.bfloat16)
  got = paged_decode_attention_tpu(q, k, v, lengths, table, INTERPRET)
  up = lambda x: x.astype(jnp.float32)
  want = decode_attention_reference(up(q), up(k), up(v), lengths, page_table=table)
  np.testing.assert_allclose(up(got), want, atol=2e-2 * float(jnp.abs(want).max()))


def test_reference_paged_equals_contiguous_and_training_attention():
  q, k, v, lengths, table = paged_inputs(batch=2)
  k_seq, v_seq = gather_pages(k, table), gather_pages(v, table)
  paged = decode_attention_reference(q, k, v, lengths, page_table=table)
  contiguous = decode_attention_reference(q, k_seq, v_seq, lengths)
  np.testing.assert_allclose(paged, contiguous, atol=1e-6)
  # The last token of a causal prefill is the decode step.
  n = int(lengths[0])
  full = pallas_kernels.attention_reference(q[:1, None], k_seq[:1, :n], v_seq[:1, :n])
  np.testing.assert_allclose(full[:, 0], contiguous[:1], atol=1e-5)


def test_dispatch_flash_on_mesh_matches_reference():
  q, k, v, lengths, table = paged_inputs(batch=4, num_heads=8, num_kv_heads=4)
  mesh = jax.make_mesh((len(jax.devices()),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  run = functools.partial(pallas_kernels.decode_attention, page_table=table)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: run(*a, AttentionSpec(implementation="flash")))(q, k, v, lengths)
  want = run(q, k, v, lengths, AttentionSpec(implementation="reference"))
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_bad_decode_arguments_name_the_argument():
  q, k, v, lengths, table = paged_inputs()
  with pytest.raises(ValueError, match="lengths"):
    paged_decode_attention_tpu(q, k, v, lengths[:2], table, INTERPRET)
  with pytest.raises(ValueError, match="heads"):
    paged_decode_attention_tpu(q[:, :3], k, v, lengths, table, INTERPRET)
  with pytest.raises(ValueError, match="page_size"):
    paged_decode_attention_gpu(q, k[:, :, :12], v[:, :, :12], lengths, table, INTERPRET)


@pytest.mark.parametrize("implementation", ["reference", "flash", "auto"])  # auto: the C++ kernel on CPU
def test_pages_before_the_window_are_never_read(implementation):
  """A sliding window narrows each row's page table to the pages it can see: pages before
  the window hold NaN here (as if handed to another sequence) and the output stays the
  masked reference's, for one token (decode) and for a chunk of several (prefill)."""
  q, k, v, lengths, table = paged_inputs(batch=3, num_heads=4, num_kv_heads=2, page_size=8,
                                         pages_per_seq=12, num_pages=36)
  lengths = jnp.array([96, 41, 9], jnp.int32)
  window = 20
  spec = AttentionSpec.of(sliding_window=window, implementation=implementation)
  want = decode_attention_reference(q, k, v, lengths, spec, page_table=table)
  page_start = jnp.arange(table.shape[1]) * 8
  gone = (page_start[None, :] + 8 <= (lengths - window)[:, None])  # [B, pages]: wholly outside
  assert int(gone.sum()) >= 8
  poison = lambda x: x.at[:, table[gone]].set(jnp.nan)
  k_gone, v_gone = poison(k), poison(v)
  got = pallas_kernels.decode_attention(q, k_gone, v_gone, lengths, spec, page_table=table)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  # Prefill: the last 5 tokens of each row at once, against the same poisoned pages.
  chunk = lengths[:, None] - 5 + jnp.arange(5)
  q_chunk = jnp.repeat(q[:, None], 5, axis=1)
  got = pallas_kernels.paged_attention(q_chunk, k_gone, v_gone, chunk, table, spec)
  for t in range(5):
    want_t = decode_attention_reference(q, k, v, chunk[:, t] + 1, spec, page_table=table)
    np.testing.assert_allclose(got[:, t], want_t, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 4, 8])
def test_gpu_kernel_splits_pages_over_programs(splits):
  """Flash-decoding: however many programs share a sequence's pages (8: more programs than
  some rows have pages), the combined partial softmaxes equal the reference, sinks included."""
  q, k, v, lengths, table = paged_inputs(num_heads=8)
  sinks = jnp.linspace(-1.0, 2.0, 8)
  window = AttentionSpec.of(sliding_window=40)
  got = paged_decode_attention_gpu(q, k, v, lengths, table, window.replace(interpret=True), sinks=sinks,
                                   splits=splits)
  want = decode_attention_reference(q, k, v, lengths, window, page_table=table, sinks=sinks)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
