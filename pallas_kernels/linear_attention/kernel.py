"""The chunked gated delta rule's Pallas kernels (kernel_tpu.py, kernel_gpu.py) as one
differentiable function: the layout the kernels read, a custom VJP whose forward saves the
state entering each chunk, and the backward's per-head pieces summed back to the inputs.

What the kernels do not do is done here in XLA, once per call and cheap (O(L H)): padding to
whole chunks, the cumulative log-decay inside each chunk (its gradient is a reverse cumsum),
the packed sequences' ordinals inside each chunk, and summing the value heads' dq, dk onto
their key head. The decay is one per head; a decay per key channel (Kimi Delta Attention)
runs the XLA chunked form (chunked.py).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.errors import UserError
from jaxpar.pallas_kernels import tiling
from jaxpar.pallas_kernels.linear_attention import kernel_gpu, kernel_tpu
from jaxpar.pallas_kernels.linear_attention.reference import segment_starts

_BACKENDS = {"tpu": kernel_tpu, "gpu": kernel_gpu}
# Triton's dot takes power-of-two tiles of at least 16; Mosaic's blocks want whole or
# (8, 128)-aligned dims, which these also are.
GPU_DIMS = (16, 32, 64, 128, 256)


class Prepared(NamedTuple):
  """The kernels' inputs: q, k [B, Hk, L, Dk]; v [B, Hv, L, Dv]; beta, cum [B, Hv, L, 1]
  (float32); seq [B, L, 1]; cum_row [B, Hv, chunks, C]; seq_row [B, chunks, C]. L is padded
  to whole chunks; cum is the log-decay summed from the chunk's first token, seq the packed
  sequence's ordinal inside the chunk (0: the one running in from before)."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  beta: jax.Array
  cum: jax.Array
  seq: jax.Array
  cum_row: jax.Array
  seq_row: jax.Array

  @property
  def state_shape(self):
    return self.k.shape[-1], self.v.shape[-1]


class _Config(NamedTuple):
  backend: str
  chunk: int
  interpret: bool


def _heads_first(x, padded):
  return jnp.swapaxes(tiling.pad_axis(x, 1, padded), 1, 2)


def _prepare(q, k, v, g, beta, starts, chunk) -> Prepared:
  batch, length, heads = v.shape[:3]
  padded = tiling.round_up(length, chunk)
  # Padding tokens (g = beta = 0, zero vectors) neither decay nor write.
  cum_row = jnp.cumsum(_heads_first(g.astype(jnp.float32), padded).reshape(batch, heads, -1, chunk), axis=-1)
  seq_row = jnp.cumsum(tiling.pad_axis(starts, 1, padded).reshape(batch, -1, chunk), axis=-1).astype(jnp.float32)
  return Prepared(q=_heads_first(q, padded), k=_heads_first(k, padded), v=_heads_first(v, padded),
                  beta=_heads_first(beta.astype(jnp.float32), padded)[..., None],
                  cum=cum_row.reshape(batch, heads, padded, 1), seq=seq_row.reshape(batch, padded, 1),
                  cum_row=cum_row, seq_row=seq_row)


def _tokens_first(x, length):
  """[B, H, padded L, D] -> [B, L, H, D]."""
  return jnp.swapaxes(x, 1, 2)[:, :length]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rule(config, q, k, v, g, beta, state, starts):
  return _forward(config, q, k, v, g, beta, state, starts)[0]


def _forward(config, q, k, v, g, beta, state, starts, save_states=False):
  p = _prepare(q, k, v, g, beta, starts, config.chunk)
  if state is None:  # made here, not by the caller: inside shard_map its gradient would vary where it does not
    state = jnp.zeros((v.shape[0], v.shape[2]) + p.state_shape, jnp.float32)
  out, final, states = _BACKENDS[config.backend].forward(p, state, chunk=config.chunk, save_states=save_states,
                                                          interpret=config.interpret)
  return (_tokens_first(out, v.shape[1]), final), states


def _rule_fwd(config, q, k, v, g, beta, state, starts):
  results, states = _forward(config, q, k, v, g, beta, state, starts, save_states=True)
  return results, (q, k, v, g, beta, state, starts, states)


def _rule_bwd(config, residuals, cotangents):
  q, k, v, g, beta, state, starts, states = residuals
  d_out, d_final = cotangents
  batch, length, key_heads = k.shape[:3]
  p = _prepare(q, k, v, g, beta, starts, config.chunk)
  d_out = _heads_first(d_out, p.v.shape[2])
  dq, dk, dv, dbeta, dcum, dcum_row, d_state = _BACKENDS[config.backend].backward(
      p, states, d_out, d_final, chunk=config.chunk, interpret=config.interpret)
  per_key_head = lambda x: _tokens_first(x.reshape(batch, key_heads, -1, *x.shape[2:]).sum(2), length)  # noqa: E731
  # cum_i sums g_j for j <= i inside the chunk, so g_j's gradient sums cum's for i >= j.
  dcum = dcum.reshape(dcum_row.shape) + dcum_row
  dg = jnp.flip(jnp.cumsum(jnp.flip(dcum, -1), -1), -1).reshape(batch, -1, p.v.shape[2])
  return (per_key_head(dq).astype(q.dtype), per_key_head(dk).astype(k.dtype), _tokens_first(dv, length).astype(v.dtype),
          jnp.swapaxes(dg, 1, 2)[:, :length].astype(g.dtype), _tokens_first(dbeta, length)[..., 0].astype(beta.dtype),
          None if state is None else d_state, None)


_rule.defvjp(_rule_fwd, _rule_bwd)


def kernel_chunk(backend, chunk_size, length):
  """The chunk the kernel runs: `chunk_size`, no longer than the sequence needs (on GPU a power of two)."""
  if backend == "gpu":
    return min(chunk_size, max(16, 1 << (length - 1).bit_length()))
  return tiling.fit_block(chunk_size, length, 8)


def check_kernel_shapes(backend, q, v, g, chunk_size):
  """One line naming what the kernel for `backend` cannot take, or None."""
  if g.ndim == 4:
    return ("the Pallas gated delta rule takes one decay per head; a decay per key channel (Kimi Delta "
            "Attention) runs implementation='chunked'")
  chunk = kernel_chunk(backend, chunk_size, v.shape[1])
  if chunk % 8:
    return f"the Pallas gated delta rule needs chunk_size a multiple of 8, got {chunk}"
  dims = (chunk, q.shape[-1], v.shape[-1])
  if backend == "gpu" and not set(dims) <= set(GPU_DIMS):
    return (f"the GPU gated delta rule needs the chunk, key and value head dims {dims} each one of {GPU_DIMS} "
            "(Triton tiles): use implementation='chunked'")
  return None


def gated_delta_rule_pallas(q, k, v, g, beta, *, initial_state=None, segment_ids=None, chunk_size=64,
                            backend="tpu", interpret=False):
  """The gated delta rule of reference.py (same arguments and results; g one decay per head)
  in `chunk_size`-token chunks (at most the padded sequence) on `backend`'s kernel."""
  length = v.shape[1]
  chunk = kernel_chunk(backend, chunk_size, length)
  problem = check_kernel_shapes(backend, q, v, g, chunk_size)
  if problem:
    raise UserError(problem)
  state = None if initial_state is None else initial_state.astype(jnp.float32)
  starts = jnp.zeros((v.shape[0], length), bool) if segment_ids is None else segment_starts(segment_ids)
  return _rule(_Config(backend, chunk, interpret), q, k, v, g, beta, state, starts)
