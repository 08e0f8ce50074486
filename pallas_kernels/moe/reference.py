"""Pure-jnp definitions of the MoE expert computations: every expert on every row, then
select. E times the work of the real paths and nothing is ever dropped: what the tests
compare the grouped and dispatched paths with."""

import jax
import jax.numpy as jnp


def swiglu(x, gate, up, down):
  """One expert: down(silu(x @ gate) * (x @ up)); x [..., D], gate/up [D, F], down [F, D]."""
  return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def _all_experts(x, gate, up, down):
  """x [..., D] -> [E, ..., D]: every expert applied to every row."""
  return jax.vmap(swiglu, in_axes=(None, 0, 0, 0))(x, gate, up, down)


def grouped_ffn_reference(rows, groups, gate, up, down):
  """rows [R, D], groups int [R] in [0, G] -> [R, D]: row r through expert groups[r];
  group G (no expert) gives zeros."""
  every = _all_experts(rows, gate, up, down)  # [G, R, D]
  num_groups = gate.shape[0]
  picked = jnp.take_along_axis(every, jnp.minimum(groups, num_groups - 1)[None, :, None], axis=0)[0]
  return jnp.where((groups < num_groups)[:, None], picked, 0)


def routed_experts_reference(x, expert_ids, weights, gate, up, down):
  """Dropless MoE: x [B, L, D], expert_ids int [B, L, k], weights [B, L, k] ->
  y [B, L, D] = sum_j weights[..., j] * expert_{expert_ids[..., j]}(x)."""
  every = _all_experts(x, gate, up, down)  # [E, B, L, D]
  chosen = jnp.take_along_axis(jnp.moveaxis(every, 0, 2), expert_ids[..., None], axis=2)  # [B, L, k, D]
  return jnp.einsum("blk,blkd->bld", weights.astype(chosen.dtype), chosen).astype(x.dtype)
