"""The C++ CPU paged decode kernel (decode_cpu.cc through XLA FFI) equals the reference for
every option the decode door takes, reads a layer of the stacked pool in place, runs per
device on a mesh, and where it cannot be built the door falls back to XLA's form with one
warning."""

import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels import AttentionSpec
from jaxpar.pallas_kernels import native
from jaxpar.pallas_kernels.attention import decode_cpu
from jaxpar.pallas_kernels.attention.reference import decode_attention_reference
from tests.test_decode_attention import paged_inputs

CASES = {
    "mha": dict(num_heads=4, num_kv_heads=4),
    "gqa": dict(num_heads=8, num_kv_heads=2),
    "mqa_head_dim_80": dict(num_heads=4, num_kv_heads=1, head_dim=80),  # a partial vector of lanes
    "window_softcap": dict(spec=AttentionSpec.of(sliding_window=20, logit_soft_cap=5.0)),
    "sinks": dict(sinks=True),
    "latent": dict(num_kv_heads=1, latent=True),
}


def stacked(x, layers=3, layer=1):
  """x as layer `layer` of a stack whose other layers hold NaN: reading them would show."""
  stack = jnp.full((layers, *x.shape), jnp.nan, x.dtype)
  return stack.at[layer].set(x)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_equals_the_reference(case):
  case = dict(CASES[case])
  spec, sinks, latent = case.pop("spec", AttentionSpec()), case.pop("sinks", False), case.pop("latent", False)
  q, k, v, lengths, table = paged_inputs(batch=5, num_pages=32, head_dim=case.pop("head_dim", 64), **case)
  lengths = jnp.array([37, 0, 96, 1, 50], jnp.int32)  # ragged, one empty, one full
  if latent:
    v, spec = None, spec.replace(value_dim=48)
  sinks = jnp.linspace(-1.0, 2.0, q.shape[1]) if sinks else None
  want = decode_attention_reference(q, k, v, lengths, spec, page_table=table, sinks=sinks)
  got = decode_cpu.paged_decode_attention_cpu(q, stacked(k), None if v is None else stacked(v), lengths,
                                              table, spec, layer=1, sinks=sinks)
  assert got.shape == want.shape and got.dtype == q.dtype
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
  assert not np.any(np.asarray(got[1])), "an empty sequence attends to nothing"


def test_bfloat16_pages():
  q, k, v, lengths, table = paged_inputs(dtype=jnp.bfloat16)
  got = decode_cpu.paged_decode_attention_cpu(q, k, v, lengths, table)  # one layer's pages
  up = lambda x: x.astype(jnp.float32)  # noqa: E731
  want = decode_attention_reference(up(q), up(k), up(v), lengths, page_table=table)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(up(got), want, atol=1e-2 * float(jnp.abs(want).max()))


def test_the_door_reads_a_stacked_layer_in_place():
  """On CPU, "auto" decode through the stacked pages and a layer index is the kernel's
  custom call with no copy of the layer's pages (a dynamic slice) and no gather of rows'
  pages, and equals that layer's pages read on their own; JAXPAR_CPU_KERNELS=0 (XLA's
  form) gives the same."""
  q, k, v, lengths, table = paged_inputs(batch=4, num_heads=8, num_kv_heads=2)
  k_stack, v_stack = stacked(k, layers=4, layer=2), stacked(v, layers=4, layer=2)
  positions = (lengths - 1)[:, None]

  def decode(q, k, v, layer):
    return pallas_kernels.paged_attention(q[:, None], k, v, positions, table, layer=layer)[:, 0]
  step = jax.jit(decode)
  got = step(q, k_stack, v_stack, 2)
  hlo = step.lower(q, k_stack, v_stack, 2).compile().as_text()
  assert decode_cpu._TARGET in hlo
  assert "dynamic-slice" not in hlo and "gather" not in hlo
  want = decode_attention_reference(q, k, v, lengths, page_table=table)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
  np.testing.assert_allclose(decode(q, k[None], v[None], 0), want, atol=2e-6, rtol=1e-5)


def test_on_a_mesh_each_device_runs_the_kernel_on_its_rows_and_heads():
  """Rows over data x fsdp and kv heads over tensor (the default rules): the same output."""
  q, k, v, lengths, table = paged_inputs(batch=4, num_heads=8, num_kv_heads=4)
  mesh = jax.make_mesh((2, 1, 2, 1, 1, 2), ("data", "stage", "fsdp", "context", "expert", "tensor"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 6)
  run = lambda *a: pallas_kernels.decode_attention(*a, page_table=table, layer=1)  # noqa: E731
  with jax.set_mesh(mesh):
    got = jax.jit(run)(q, stacked(k), stacked(v), lengths)
    assert "shard_map" in str(jax.make_jaxpr(run)(q, stacked(k), stacked(v), lengths))
  want = decode_attention_reference(q, k, v, lengths, page_table=table)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_without_a_compiler_the_door_warns_once_and_takes_xla(tmp_path, monkeypatch, caplog):
  source = tmp_path / "decode_cpu.cc"
  shutil.copy(decode_cpu._SOURCE, source)
  monkeypatch.setenv("JAXPAR_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  with caplog.at_level(logging.WARNING):
    assert native.load(source, (decode_cpu._TARGET,)) is False
  assert "CXX" in caplog.text and "no-such-compiler" in caplog.text
  broken = tmp_path / "broken.cc"
  broken.write_text("this is not C++\n")
  monkeypatch.setenv("CXX", shutil.which("c++") or shutil.which("g++"))
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert native.load(broken, ("Nothing",)) is False
  assert "broken.cc" in caplog.text and "error" in caplog.text
  assert not list((tmp_path / "cache").rglob("*.so")), "a failed build leaves no library behind"
  # The door without the kernel: XLA's form, the same function.
  monkeypatch.setenv("JAXPAR_CPU_KERNELS", "0")
  q, k, v, lengths, table = paged_inputs()
  assert not decode_cpu.available(q.dtype, k.dtype)
  got = pallas_kernels.decode_attention(q, k, v, lengths, page_table=table)
  np.testing.assert_allclose(got, decode_attention_reference(q, k, v, lengths, page_table=table), atol=1e-5)
