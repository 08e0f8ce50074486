"""The chunked gated delta rule as Pallas TPU (Mosaic) kernels: a grid over (batch, value
head, chunk), the chunk axis sequential ("arbitrary"), the state [Dk, Dv] held in VMEM
scratch between chunks. The backward walks the chunks in reverse from the chunk-entering
states the forward saved, carrying the state's cotangent the same way.

Arrays come laid out by kernel.py: heads before length, vectors along the chunk as columns
[.., L, 1] and the pairwise terms' rows as [.., chunks, 1, C], so every block's last two
dims are whole or (8, 128)-aligned. Value head h reads key head h // group.
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpar.pallas_kernels.attention.blockwise import out_struct
from jaxpar.pallas_kernels.linear_attention import chunk_math


def _specs(p, chunk, reverse):
  """BlockSpecs for kernel.Prepared's arrays plus the per-chunk state blocks, walking the
  chunks forward or in reverse."""
  count = p.cum_row.shape[2]
  group = p.v.shape[1] // p.k.shape[1]
  at = (lambda c: count - 1 - c) if reverse else (lambda c: c)
  tokens = lambda d, heads=True: pl.BlockSpec(  # noqa: E731
      (None, None, chunk, d), (lambda b, h, c: (b, h, at(c), 0)) if heads else
      (lambda b, h, c: (b, h // group, at(c), 0)))
  return dict(
      keys=tokens(p.k.shape[-1], heads=False), values=tokens(p.v.shape[-1]), keyed=tokens(p.k.shape[-1]),
      column=tokens(1), seq=pl.BlockSpec((None, chunk, 1), lambda b, h, c: (b, at(c), 0)),
      row=pl.BlockSpec((None, None, None, 1, chunk), lambda b, h, c: (b, h, at(c), 0, 0)),
      seq_row=pl.BlockSpec((None, None, 1, chunk), lambda b, h, c: (b, at(c), 0, 0)),
      state=pl.BlockSpec((None, None) + p.state_shape, lambda b, h, c: (b, h, 0, 0)),
      states=pl.BlockSpec((None, None, None) + p.state_shape, lambda b, h, c: (b, h, at(c), 0, 0)))


def _inputs(p):
  """Prepared's arrays in the order the kernels take them, rows with their unit axis."""
  return (p.q, p.k, p.v, p.beta, p.cum, p.seq, p.cum_row[..., None, :], p.seq_row[..., None, :])


def _in_specs(s):
  return [s["keys"], s["keys"], s["values"], s["column"], s["column"], s["seq"], s["row"], s["seq_row"]]


def _chunk(refs):
  q, k, v, beta, cum, seq, cum_row, seq_row = (r[...].astype(jnp.float32) for r in refs)
  return chunk_math.Chunk(q, k, v, beta, cum, seq, cum_row, seq_row)


def _fwd_kernel(*refs, save_states):
  chunk, (s0_ref, out_ref, final_ref), rest = refs[:8], refs[8:11], refs[11:]
  states_ref, state_scr = (rest if save_states else (None, *rest))
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _init():
    state_scr[...] = s0_ref[...]

  state = state_scr[...]
  if save_states:
    states_ref[...] = state
  out, state = chunk_math.forward(_chunk(chunk), state)
  out_ref[...] = out.astype(out_ref.dtype)
  state_scr[...] = state

  @pl.when(c == pl.num_programs(2) - 1)
  def _finish():
    final_ref[...] = state


def _bwd_kernel(*refs):
  chunk, (states_ref, d_out_ref, d_final_ref), outs, d_state_scr = refs[:8], refs[8:11], refs[11:18], refs[18]
  dq_ref, dk_ref, dv_ref, dbeta_ref, dcum_ref, dcum_row_ref, d_s0_ref = outs
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _init():
    d_state_scr[...] = d_final_ref[...]

  grads = chunk_math.backward(_chunk(chunk), states_ref[...], d_out_ref[...].astype(jnp.float32),
                              d_state_scr[...])
  for ref, grad in zip(outs[:6], grads[:6]):
    ref[...] = grad.astype(ref.dtype)
  d_state_scr[...] = grads.state

  @pl.when(c == pl.num_programs(2) - 1)
  def _finish():
    d_s0_ref[...] = grads.state


def _call(kernel, p, grid, in_specs, out_specs, out_shape, name, interpret):
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        scratch_shapes=[pltpu.VMEM(p.state_shape, jnp.float32)], compiler_params=params,
                        interpret=interpret, name=name)


def forward(p, state, *, chunk, save_states, interpret):
  """kernel.py's forward: (out [B, Hv, L, Dv], final state, chunk-entering states or None)."""
  batch, heads, count = p.cum_row.shape[:3]
  s = _specs(p, chunk, reverse=False)
  like = lambda shape, dtype: out_struct(shape, dtype, p.v)  # noqa: E731
  out_specs = [s["values"], s["state"]] + ([s["states"]] if save_states else [])
  out_shape = [like(p.v.shape, p.v.dtype), like(state.shape, jnp.float32)]
  out_shape += [like((batch, heads, count) + p.state_shape, jnp.float32)] if save_states else []
  results = _call(functools.partial(_fwd_kernel, save_states=save_states), p, (batch, heads, count),
                  _in_specs(s) + [s["state"]], out_specs, out_shape, "gated_delta_rule_fwd", interpret)(
                      *_inputs(p), state)
  return (*results, None) if not save_states else tuple(results)


def backward(p, states, d_out, d_final, *, chunk, interpret):
  """kernel.py's backward: per-value-head dq, dk, then dv, dbeta, dcum, dcum_row, d_state0."""
  batch, heads, count = p.cum_row.shape[:3]
  s = _specs(p, chunk, reverse=True)
  like = lambda shape, dtype=jnp.float32: out_struct(shape, dtype, p.v)  # noqa: E731
  keyed = (batch, heads) + p.k.shape[2:]
  out_shape = [like(keyed), like(keyed), like(p.v.shape), like(p.beta.shape), like(p.cum.shape),
               like((batch, heads, count, 1, chunk)), like(d_final.shape)]
  out_specs = [s["keyed"], s["keyed"], s["values"], s["column"], s["column"], s["row"], s["state"]]
  *grads, d_cum_row, d_state = _call(
      _bwd_kernel, p, (batch, heads, count), _in_specs(s) + [s["states"], s["values"], s["state"]],
      out_specs, out_shape, "gated_delta_rule_bwd", interpret)(*_inputs(p), states, d_out, d_final)
  return (*grads, d_cum_row[..., 0, :], d_state)

