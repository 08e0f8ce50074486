"""The gated delta rule's Pallas kernels compile for real TPU chips (libtpu, through the
door on a multi-device topology mesh, where "auto" picks them) and lower for CUDA (Triton),
forward and backward, without hardware. Their numerics: tests/test_gated_delta_rule.py."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels.linear_attention.kernel import gated_delta_rule_pallas
from tests.test_attention_compile import _export_cuda, _topology_mesh

# Qwen3.5's linear layers: key and value heads of 128, two value heads per key head.
KEY_HEADS, VALUE_HEADS, HEAD_DIM, LENGTH = 4, 8, 128, 2048


def _loss(rule):
  def loss(q, k, v, g, beta, state, segments):
    out, final = rule(q, k, v, g, beta, initial_state=state, segment_ids=segments)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final)
  return jax.grad(loss, argnums=tuple(range(6)))


def _shapes(batch, sds=lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype)):
  heads = P("data", None, "tensor")
  tokens = lambda heads_, dtype=jnp.bfloat16: sds((batch, LENGTH, heads_, HEAD_DIM), dtype, heads)  # noqa: E731
  per_head = sds((batch, LENGTH, VALUE_HEADS), jnp.float32, heads)
  return (tokens(KEY_HEADS), tokens(KEY_HEADS), tokens(VALUE_HEADS), per_head, per_head,
          sds((batch, VALUE_HEADS, HEAD_DIM, HEAD_DIM), jnp.float32, P("data", "tensor")),
          sds((batch, LENGTH), jnp.int32, P("data")))


@pytest.mark.tpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_tpu_kernels_compile_and_auto_picks_them(topology):
  mesh = _topology_mesh(topology)
  sds = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
  with jax.set_mesh(mesh):
    compiled = jax.jit(_loss(pallas_kernels.gated_delta_rule)).lower(*_shapes(mesh.shape["data"], sds)).compile()
  assert compiled.as_text().count("tpu_custom_call") == 2  # the forward and the backward kernel


def test_gpu_kernels_lower_for_cuda():
  rule = lambda *args, **kw: gated_delta_rule_pallas(*args, backend="gpu", **kw)  # noqa: E731
  assert _export_cuda(_loss(rule), *_shapes(2)) == 2
