"""XLA's CPU paged decode (keys gathered whole and kept on the left of the product) equals the
reference, with GQA, windows, soft-capping and an empty sequence; it is what "auto" runs
on CPU where the C++ kernel cannot (JAXPAR_CPU_KERNELS=0 here; tests/test_decode_cpu.py
checks the kernel)."""

import numpy as np
import pytest

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels import AttentionSpec
from jaxpar.pallas_kernels.attention.decode_xla import paged_decode_attention_xla
from jaxpar.pallas_kernels.attention.reference import decode_attention_reference
from tests.test_decode_attention import OPTIONS, paged_inputs


@pytest.mark.parametrize("spec", OPTIONS, ids=["plain", "window_softcap"])
@pytest.mark.parametrize("group", [1, 4])
def test_xla_paged_decode_equals_the_reference(spec, group, monkeypatch):
  q, k, v, lengths, table = paged_inputs(num_heads=2 * group, head_dim=64)
  got = paged_decode_attention_xla(q, k, v, lengths, table, spec)
  want = decode_attention_reference(q, k, v, lengths, spec, page_table=table)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  assert not np.any(got[1]), "an empty sequence attends to nothing"
  monkeypatch.setenv("JAXPAR_CPU_KERNELS", "0")
  auto = pallas_kernels.decode_attention(q, k, v, lengths, spec, page_table=table)
  np.testing.assert_allclose(auto, want, atol=1e-5, rtol=1e-5)
  if spec.sliding_window is None:  # with a window "auto" first narrows the table to the window's pages (other sums)
    np.testing.assert_array_equal(auto, got)


@pytest.mark.parametrize("num_heads", [2, 4], ids=["one_query_per_kv_head", "grouped"])
def test_xla_paged_decode_with_sinks_and_a_latent_cache(num_heads):
  """GPT-OSS's sinks and MLA's latent cache (values = the keys' first entries, v pages None)
  through the CPU form equal the reference, and the sinks change the result; in both score
  layouts (one query per kv head, grouped queries)."""
  q, k, _, lengths, table = paged_inputs(num_heads=num_heads, head_dim=64)
  sinks = np.linspace(-1.0, 2.0, num_heads).astype(np.float32)
  latent = AttentionSpec(value_dim=32)
  got = paged_decode_attention_xla(q, k, None, lengths, table, latent, sinks=sinks)
  want = decode_attention_reference(q, k, None, lengths, latent, page_table=table, sinks=sinks)
  assert got.shape == q.shape[:2] + (32,)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  auto = pallas_kernels.decode_attention(q, k, None, lengths, latent, page_table=table, sinks=sinks)
  np.testing.assert_allclose(auto, want, atol=1e-5, rtol=1e-5)
  without = paged_decode_attention_xla(q, k, None, lengths, table, latent)
  assert np.abs(np.asarray(without) - np.asarray(got)).max() > 1e-3
