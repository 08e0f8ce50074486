"""The train-precision schemes of models/low_precision.py, defined in plain jnp on 2-D operands.

Each of a projection's three matmuls (y = x @ w; dx = g @ w.T; dw = x.T @ g) quantizes both
operands, multiplies the quantized values with f32 accumulation and multiplies the result by
the operands' scales. A scale is absmax / the type's bound (448 for e4m3, 57344 for e5m2,
127.5 for int8, whose values round to the nearest integer) over its group:

| scheme | forward x, w | dx: g, w | dw: x, g |
| --- | --- | --- | --- |
| fp8 | per tensor (e4m3) | g * s_w per tensor (e5m2), w's forward values | g * s_x per tensor (e5m2), x's forward values |
| fp8_blockwise | x 1 x T tiles per row, w T x T blocks (e4m3) | g 1 x T (e5m2), w's T x T blocks | x T x 1 per column, g T x 1 (e5m2) |
| int8 | per row of x, per column of w | g * s_w per row | g * s_x per column |
| int8_stochastic | as int8 | as int8, g rounded with noise | as int8, g rounded with noise |

T is 128 where it divides the contracted axis, else the whole axis. Stochastic rounding adds
uniform noise in [-0.5, 0.5) to the scaled gradient before rounding it to the nearest
integer, drawn for dx and dw from `keys` (jax.random.uniform). Where a backward matmul
reuses an operand's forward values, the operand's scales are folded into the gradient before
it is quantized (they lie along the backward's contracted axis, so they cannot multiply the
result). The tests hold models/low_precision.py to these definitions.
"""

import jax
import jax.numpy as jnp

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _bound(qtype) -> float:
  return float(jnp.finfo(qtype).max) if jnp.issubdtype(qtype, jnp.floating) else 127.5


def quantize(a, qtype, axes, noise=None):
  """a quantized to qtype with one scale per group that reduces `axes` (None: whole tensor),
  `noise` (int8) added to the scaled values before they round. -> (values, scales shaped to
  broadcast against a)."""
  absmax = jnp.max(jnp.abs(a), axis=axes, keepdims=True)
  scale = absmax / _bound(qtype)
  scale = jnp.where(scale < jnp.sqrt(jnp.finfo(scale.dtype).tiny), 1, scale).astype(a.dtype)
  scaled = a / scale
  if jnp.issubdtype(qtype, jnp.floating):
    info = jnp.finfo(qtype)
    return scaled.clip(info.min.astype(a.dtype), info.max.astype(a.dtype)).astype(qtype), scale
  if noise is not None:
    scaled = scaled.astype(jnp.float32) + noise
  return jnp.round(scaled).astype(qtype), scale


def _tile(size: int) -> int:
  return 128 if size % 128 == 0 else size


def _tiled_dot(a, b, qa, qb, b_blocks=False):
  """a [M, K] @ b [K, N] with a quantized per row in tiles along K and b per column in tiles
  along K, or (`b_blocks`) in T x T blocks (dtypes qa, qb): each tile's f32 product times its
  scales, summed tile by tile."""
  t, n = _tile(a.shape[1]), b.shape[1]
  columns = _tile(n) if b_blocks else 1
  acc = None
  for start in range(0, a.shape[1], t):
    va, sa = quantize(a[:, start:start + t], qa, axes=1)
    vb, sb = quantize(b[start:start + t].reshape(t, n // columns, columns), qb, axes=(0, 2))
    vb, sb = vb.reshape(t, n), jnp.repeat(sb.reshape(1, n // columns), columns, axis=1)
    out = _f32_dot(va, vb) * sa * sb
    acc = out if acc is None else acc + out
  return acc


def _f32_dot(va, vb):
  return jnp.dot(va.astype(jnp.float32), vb.astype(jnp.float32))


def _per_axes(scheme):
  """The axes each operand's scales reduce when rows are [tokens or K] and columns [outputs]:
  None (per tensor) for fp8, the contracted axis for int8."""
  return (None, None) if scheme == "fp8" else (1, 0)


def reference_matmul(x, w, scheme: str, keys=None):
  """x [M, K] @ w [K, N] under `scheme`, with the backward pass its table row defines
  (int8_stochastic: `keys`, the noise keys of dx's and dw's gradient rounding)."""

  def noise(i, shape):  # dx's (0) or dw's (1) rounding noise; none: round to nearest
    return None if keys is None else jax.random.uniform(keys[i], shape, jnp.float32, -0.5, 0.5)

  @jax.custom_vjp
  def matmul(x, w):
    return forward(x, w)[0]

  def forward(x, w):
    if scheme == "fp8_blockwise":
      return _tiled_dot(x, w, E4M3, E4M3, b_blocks=True).astype(x.dtype), (x, w)
    qtype = E4M3 if scheme == "fp8" else jnp.int8
    x_axes, w_axes = _per_axes(scheme)
    (vx, sx), (vw, sw) = quantize(x, qtype, x_axes), quantize(w, qtype, w_axes)
    return (_f32_dot(vx, vw) * sx * sw).astype(x.dtype), (vx, sx, vw, sw)

  def backward(saved, g):
    if scheme == "fp8_blockwise":
      x, w = saved
      dx = _tiled_dot(g, w.T, E5M2, E4M3, b_blocks=True)
      dw = _tiled_dot(x.T, g, E4M3, E5M2)
      return dx.astype(x.dtype), dw.astype(w.dtype)
    vx, sx, vw, sw = saved
    qtype = E5M2 if scheme == "fp8" else jnp.int8
    x_axes, w_axes = _per_axes(scheme)
    # dx: g's columns meet w's columns, whose scales fold into g; g then scales per row.
    vg, sg = quantize(g * sw, qtype, x_axes, noise(0, g.shape))
    dx = _f32_dot(vg, vw.T) * sg
    # dw: g's rows meet x's rows, whose scales fold into g; g then scales per column.
    vg, sg = quantize(g * sx, qtype, w_axes, noise(1, g.shape))
    dw = _f32_dot(vx.T, vg) * sg
    return dx.astype(sx.dtype), dw.astype(sw.dtype)

  matmul.defvjp(forward, backward)
  return matmul(x, w)


def reference_delayed_matmul(x, w, history):
  """fp8_delayed on x [M, K] @ w [K, N] with `history` [3, H] (input, weight, gradient rows):
  fp8's per-tensor matmuls, each tensor scaled by its row's largest maximum (its own maximum
  while the row is all zeros) and saturated to the type's range. -> (y, the history after
  the pass: every row rolled with its tensor's maximum, the gradient's once backward ran),
  as one function of x and w whose vjp is the backward pass (the history's row 2 read then)."""

  def scaled(a, row, qtype):
    bound = float(jnp.finfo(qtype).max)
    past = jnp.max(row)
    amax = jnp.where(past > 0, past, jnp.max(jnp.abs(a)))
    s = jnp.where(amax > 0, amax, 1.0) / bound
    return jnp.clip(a / s, -bound, bound).astype(qtype), s

  @jax.custom_vjp
  def matmul(x, w):
    return forward(x, w)[0]

  def forward(x, w):
    (vx, sx), (vw, sw) = scaled(x, history[0], E4M3), scaled(w, history[1], E4M3)
    return _f32_dot(vx, vw) * (sx * sw), (vx, sx, vw, sw)

  def backward(saved, g):
    vx, sx, vw, sw = saved
    vg, sg = scaled(g, history[2], E5M2)
    return _f32_dot(vg, vw.T) * (sg * sw), _f32_dot(vx.T, vg) * (sx * sg)

  matmul.defvjp(forward, backward)
  return matmul(x, w)
