"""The chunked gated delta rule as Pallas GPU (Triton) kernels: one program per (batch,
value head) walks the chunks in a loop, the state [Dk, Dv] carried in registers, loading
each chunk's tiles from the whole sequence (Triton reads strided tiles in place). The
backward walks them in reverse from the chunk-entering states the forward saved.

Triton tiles must be powers of two of at least 16 for its dot: the chunk, Dk and Dv
(kernel.py checks). Arrays come laid out by kernel.py; the saved states are stacked along
Dk ([B, Hv, chunks * Dk, Dv]) so each chunk's is a 2-D tile.
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxpar.pallas_kernels.attention.blockwise import out_struct
from jaxpar.pallas_kernels.linear_attention import chunk_math

_PARAMS = dict(num_warps=4, num_stages=1)


def _whole(x, group=1):
  """The (batch, head) program's whole slice of x [B, H, ..]; key tensors by key head."""
  return pl.BlockSpec((None, None) + x.shape[2:], lambda b, h: (b, h // group) + (0,) * (x.ndim - 2))


def _chunk(refs, c, chunk):
  q, k, v, beta, cum, seq, cum_row, seq_row = refs
  rows, one = pl.ds(c * chunk, chunk), pl.ds(c, 1)
  tiles = [r[rows, :] for r in (q, k, v, beta, cum)] + [seq[rows, :], cum_row[one, :], seq_row[one, :]]
  return chunk_math.Chunk(*(t.astype(jnp.float32) for t in tiles))


def _fwd_kernel(*refs, chunk, count, key_dim, save_states):
  inputs, s0_ref, out_ref, final_ref = refs[:8], refs[8], refs[9], refs[10]
  states_ref = refs[11] if save_states else None

  def step(c, state):
    if save_states:
      states_ref[pl.ds(c * key_dim, key_dim), :] = state
    out, state = chunk_math.forward(_chunk(inputs, c, chunk), state)
    out_ref[pl.ds(c * chunk, chunk), :] = out.astype(out_ref.dtype)
    return state

  final_ref[...] = lax.fori_loop(0, count, step, s0_ref[...])


def _bwd_kernel(*refs, chunk, count, key_dim):
  inputs, (states_ref, d_out_ref, d_final_ref), outs = refs[:8], refs[8:11], refs[11:]
  dq_ref, dk_ref, dv_ref, dbeta_ref, dcum_ref, dcum_row_ref, d_s0_ref = outs

  def step(i, d_state):
    c = count - 1 - i
    rows = pl.ds(c * chunk, chunk)
    grads = chunk_math.backward(_chunk(inputs, c, chunk), states_ref[pl.ds(c * key_dim, key_dim), :],
                                d_out_ref[rows, :].astype(jnp.float32), d_state)
    for ref, grad in zip((dq_ref, dk_ref, dv_ref, dbeta_ref, dcum_ref), grads[:5]):
      ref[rows, :] = grad.astype(ref.dtype)
    dcum_row_ref[pl.ds(c, 1), :] = grads.cum_row
    return grads.state

  d_s0_ref[...] = lax.fori_loop(0, count, step, d_final_ref[...])


def _call(kernel, p, chunk, inputs, out_shape, name, interpret):
  batch, heads, count = p.cum_row.shape[:3]
  group = heads // p.k.shape[1]
  body = functools.partial(kernel, chunk=chunk, count=count, key_dim=p.k.shape[-1])
  per_row = lambda x: pl.BlockSpec((None,) + x.shape[1:], lambda b, h: (b,) + (0,) * (x.ndim - 1))  # noqa: E731
  # q, k by key head; the segment ordinals (5, 7) are per batch row, not per head.
  in_specs = [per_row(x) if i in (5, 7) else _whole(x, group if i < 2 else 1) for i, x in enumerate(inputs)]
  return pl.pallas_call(body, grid=(batch, heads), in_specs=in_specs, out_specs=[_whole(x) for x in out_shape],
                        out_shape=out_shape, compiler_params=plgpu.CompilerParams(**_PARAMS),
                        interpret=interpret, name=name)(*inputs)


def _inputs(p):
  return (p.q, p.k, p.v, p.beta, p.cum, p.seq, p.cum_row, p.seq_row)


def forward(p, state, *, chunk, save_states, interpret):
  """kernel.py's forward: (out [B, Hv, L, Dv], final state, chunk-entering states or None)."""
  batch, heads, count = p.cum_row.shape[:3]
  key_dim, value_dim = p.state_shape
  like = lambda shape, dtype=jnp.float32: out_struct(shape, dtype, p.v)  # noqa: E731
  out_shape = [like(p.v.shape, p.v.dtype), like(state.shape)]
  out_shape += [like((batch, heads, count * key_dim, value_dim))] if save_states else []
  results = _call(functools.partial(_fwd_kernel, save_states=save_states), p, chunk, (*_inputs(p), state),
                  out_shape, "gated_delta_rule_fwd", interpret)
  if not save_states:
    return (*results, None)
  out, final, states = results
  return out, final, states.reshape(batch, heads, count, key_dim, value_dim)


def backward(p, states, d_out, d_final, *, chunk, interpret):
  """kernel.py's backward: per-value-head dq, dk, then dv, dbeta, dcum, dcum_row, d_state0."""
  batch, heads, count = p.cum_row.shape[:3]
  like = lambda shape: out_struct(shape, jnp.float32, p.v)  # noqa: E731
  keyed = (batch, heads) + p.k.shape[2:]
  out_shape = [like(keyed), like(keyed), like(p.v.shape), like(p.beta.shape), like(p.cum.shape),
               like(p.cum_row.shape), like(d_final.shape)]
  stacked = states.reshape(batch, heads, -1, states.shape[-1])
  return tuple(_call(_bwd_kernel, p, chunk, (*_inputs(p), stacked, d_out, d_final), out_shape,
                     "gated_delta_rule_bwd", interpret))
