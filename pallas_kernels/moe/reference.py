"""Pure-jnp definitions of the MoE expert computations: every expert on every row, then
select. E times the work of the real paths and nothing is ever dropped: what the tests
compare the grouped and dispatched paths with."""

import jax
import jax.numpy as jnp


def silu_glu(gate, up):
  """SwiGLU's hidden activation from the two projections: silu(gate) * up. The `glu` every
  path takes by default; a model may pass its own variant (GPT-OSS's clamped one)."""
  return jax.nn.silu(gate) * up


def swiglu(x, gate, up, down, gate_bias=0.0, up_bias=0.0, glu=silu_glu, matmul=None):
  """One expert: down(glu(x @ gate + gate_bias, x @ up + up_bias)); x [..., D], gate/up
  [D, F], their biases [F], down [F, D]; `matmul(x, w)` each product (None: x @ w)."""
  mm = matmul or jnp.matmul
  return mm(glu(mm(x, gate) + gate_bias, mm(x, up) + up_bias), down)


def _all_experts(x, gate, up, down, biases, glu, matmul=None):
  """x [..., D] -> [E, ..., D]: every expert applied to every row."""
  biases = (0.0, 0.0) if biases is None else biases
  axes = tuple(None if isinstance(b, float) else 0 for b in biases)
  return jax.vmap(lambda *a: swiglu(*a, glu=glu, matmul=matmul), in_axes=(None, 0, 0, 0) + axes)(
      x, gate, up, down, *biases)


def grouped_ffn_reference(rows, groups, gate, up, down, biases=None, glu=silu_glu, matmul=None):
  """rows [R, D], groups int [R] in [0, G] -> [R, D]: row r through expert groups[r];
  group G (no expert) gives zeros. biases: None or (gate_bias, up_bias) [G, F]."""
  every = _all_experts(rows, gate, up, down, biases, glu, matmul)  # [G, R, D]
  num_groups = gate.shape[0]
  picked = jnp.take_along_axis(every, jnp.minimum(groups, num_groups - 1)[None, :, None], axis=0)[0]
  return jnp.where((groups < num_groups)[:, None], picked, 0)


def routed_experts_reference(x, expert_ids, weights, gate, up, down, biases=None, glu=silu_glu, matmul=None):
  """Dropless MoE: x [B, L, D], expert_ids int [B, L, k], weights [B, L, k] ->
  y [B, L, D] = sum_j weights[..., j] * expert_{expert_ids[..., j]}(x)."""
  every = _all_experts(x, gate, up, down, biases, glu, matmul)  # [E, B, L, D]
  chosen = jnp.take_along_axis(jnp.moveaxis(every, 0, 2), expert_ids[..., None], axis=2)  # [B, L, k, D]
  return jnp.einsum("blk,blkd->bld", weights.astype(chosen.dtype), chosen).astype(x.dtype)
