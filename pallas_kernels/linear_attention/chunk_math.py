"""One chunk of the gated delta rule, forward and backward, as the 2-D array math a Pallas
kernel body runs: kernel_tpu.py calls it once per grid step, kernel_gpu.py once per loop
turn. Same equations as chunked.py (its docstring derives them); here the backward is
written out, because a kernel cannot be differentiated by JAX.

Per chunk of C tokens and one value head, with G the cumulative log-decay inside the chunk:

  A = beta_i (k_i . k_j) exp(G_i - G_j)   (j < i, same sequence)   P = (q_i . k_j) exp(G_i - G_j)   (j <= i)
  T = (I + A)^-1,  W = T (beta exp(G) k),  U0 = T (beta v),  u = U0 - W S
  out = (exp(G) q) S + P u,  S' = exp(G_last) S + (exp(G_last - G) k)^T u

The kernels hold X = T^T rather than T (forward substitution builds it a column at a time
from rows of A, with no transpose), and every product is one of three matmul shapes.
Vectors along the chunk are columns [C, 1]; the cumulative decay and segment ordinals also
come as rows [1, C] for the pairwise [C, C] terms. Segment ordinals are floats (0 for the
sequence running in from before the chunk), exact for any chunk length a kernel uses.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST


def mm(a, b):
  """a @ b in float32."""
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32)


def mm_nt(a, b):
  """a @ b^T."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32)


def mm_tn(a, b):
  """a^T @ b."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=jnp.float32)


class Chunk(NamedTuple):
  """One chunk's inputs for one value head, float32: q, k [C, Dk]; v [C, Dv]; beta, cum, seq
  [C, 1]; cum_row, seq_row [1, C] (the same cumulative log-decay and segment ordinals as rows)."""
  q: jnp.ndarray
  k: jnp.ndarray
  v: jnp.ndarray
  beta: jnp.ndarray
  cum: jnp.ndarray
  seq: jnp.ndarray
  cum_row: jnp.ndarray
  seq_row: jnp.ndarray


class Decays(NamedTuple):
  strict: jnp.ndarray  # [C, C] exp(G_i - G_j) for j < i in the same sequence, else 0
  upto: jnp.ndarray  # [C, C] the same for j <= i
  read: jnp.ndarray  # [C, 1] exp(G_i) where the token still reads the entering state, else 0
  write: jnp.ndarray  # [C, 1] exp(G_last - G_i) where the token's sequence reaches the chunk's end
  carry: jnp.ndarray  # [1, 1] exp(G_last) if no sequence starts in the chunk, else 0


def _masked_exp(exponent, mask):
  """exp where mask, else 0; a masked exponent (maybe large and positive) never reaches exp."""
  return jnp.exp(jnp.where(mask, exponent, -jnp.inf))


def _iotas(size):
  return lax.broadcasted_iota(jnp.int32, (size, size), 0), lax.broadcasted_iota(jnp.int32, (size, size), 1)


def _last_column(size):
  return lax.broadcasted_iota(jnp.int32, (1, size), 1) == size - 1


def _row_sums(x):
  return jnp.sum(x, axis=1, keepdims=True)


def _total(x):
  return jnp.sum(jnp.sum(x, axis=1, keepdims=True), axis=0, keepdims=True)


def decays(c: Chunk) -> Decays:
  size = c.cum.shape[0]
  rows, cols = _iotas(size)
  same = c.seq == c.seq_row
  gaps = c.cum - c.cum_row
  cum_last = jnp.sum(jnp.where(_last_column(size), c.cum_row, 0.0), axis=1, keepdims=True)
  seq_last = jnp.max(c.seq_row, axis=1, keepdims=True)  # ordinals never decrease along the chunk
  return Decays(strict=_masked_exp(gaps, same & (rows > cols)), upto=_masked_exp(gaps, same & (rows >= cols)),
                read=_masked_exp(c.cum, c.seq == 0.0), write=_masked_exp(cum_last - c.cum, c.seq == seq_last),
                carry=_masked_exp(cum_last, seq_last == 0.0))


def transposed_inverse(a):
  """X = ((I + a)^-1)^T for `a` [C, C] strictly lower-triangular. Column i of X is
  e_i - X a[i, :]^T: it reads only columns j < i (a[i, j] = 0 for j >= i), already built."""
  size = a.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
  row_ids, column_ids = (lax.broadcasted_iota(jnp.int32, shape, axis) for shape, axis in (((size, 1), 0), ((1, size), 1)))

  def column(i, x):
    a_row = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0, keepdims=True)  # [1, C]
    new = jnp.where(row_ids == i, 1.0, 0.0) - _row_sums(x * a_row)  # [C, 1]
    return jnp.where(column_ids == i, new, x)

  return lax.fori_loop(0, size, column, jnp.zeros_like(a))


class _Solved(NamedTuple):
  d: Decays
  kk: jnp.ndarray
  qk: jnp.ndarray
  attn: jnp.ndarray  # P
  x: jnp.ndarray  # T^T
  reads: jnp.ndarray  # beta exp(G) k, what T turns into W
  writes: jnp.ndarray  # beta v, what T turns into U0
  w: jnp.ndarray
  u: jnp.ndarray


def _solve(c: Chunk, state) -> _Solved:
  d = decays(c)
  kk, qk = mm_nt(c.k, c.k), mm_nt(c.q, c.k)
  x = transposed_inverse(c.beta * kk * d.strict)
  reads, writes = c.beta * d.read * c.k, c.beta * c.v
  w = mm_tn(x, reads)
  u = mm_tn(x, writes) - mm(w, state)
  return _Solved(d, kk, qk, qk * d.upto, x, reads, writes, w, u)


def forward(c: Chunk, state):
  """(out [C, Dv], the state leaving the chunk [Dk, Dv]) from the state entering it."""
  s = _solve(c, state)
  out = mm(s.d.read * c.q, state) + mm(s.attn, s.u)
  return out, s.d.carry * state + mm_tn(s.d.write * c.k, s.u)


class Gradients(NamedTuple):
  q: jnp.ndarray  # [C, Dk]
  k: jnp.ndarray  # [C, Dk]
  v: jnp.ndarray  # [C, Dv]
  beta: jnp.ndarray  # [C, 1]
  cum: jnp.ndarray  # [C, 1], the cumulative decay's gradient through its column form
  cum_row: jnp.ndarray  # [1, C], and through its row form (the caller adds the two)
  state: jnp.ndarray  # [Dk, Dv], the entering state's


def backward(c: Chunk, state, d_out, d_next) -> Gradients:
  """Gradients of one chunk, given the state entering it, the cotangents of its outputs
  [C, Dv] and of the state leaving it [Dk, Dv]."""
  s = _solve(c, state)
  d = s.d
  read_q, write_k = d.read * c.q, d.write * c.k
  d_u = mm_tn(s.attn, d_out) + mm(write_k, d_next)
  d_state = d.carry * d_next + mm_tn(read_q, d_out) - mm_tn(s.w, d_u)
  d_read_q, d_write_k = mm_nt(d_out, state), mm_nt(s.u, d_next)
  d_w = -mm_nt(d_u, state)
  d_reads, d_writes = mm(s.x, d_w), mm(s.x, d_u)
  d_a = -mm(mm(s.x, mm_nt(d_w, s.reads) + mm_nt(d_u, s.writes)), s.x)  # through T = (I + A)^-1
  d_strict = d_a * c.beta * s.kk  # A = beta kk strict
  d_kk = d_a * c.beta * d.strict
  d_attn = mm_nt(d_out, s.u)
  d_qk = d_attn * d.upto  # P = qk upto
  d_read = jnp.sum(c.q * d_read_q + c.beta * c.k * d_reads, axis=1, keepdims=True)
  d_write = jnp.sum(c.k * d_write_k, axis=1, keepdims=True)
  d_gaps = d_strict * d.strict + d_attn * s.qk * d.upto  # exp' = exp; masked entries are 0
  d_cum_last = _total(d_write * d.write) + _total(state * d_next) * d.carry
  return Gradients(
      q=d.read * d_read_q + mm(d_qk, c.k),
      k=d.write * d_write_k + mm_tn(d_qk, c.q) + mm(d_kk, c.k) + mm_tn(d_kk, c.k) + c.beta * d.read * d_reads,
      v=c.beta * d_writes,
      beta=_row_sums(d_a * s.kk * d.strict) + _row_sums(d.read * c.k * d_reads) + _row_sums(c.v * d_writes),
      cum=jnp.sum(d_gaps, axis=1, keepdims=True) + d_read * d.read - d_write * d.write,
      cum_row=-jnp.sum(d_gaps, axis=0, keepdims=True) + jnp.where(_last_column(c.cum.shape[0]), d_cum_last, 0.0),
      state=d_state)
