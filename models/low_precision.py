"""Projection matmuls in fp8 or int8 while training (`model.train_precision`).

The weights stay float (param_dtype) and the optimizer sees float gradients: each projection's
three matmuls (forward, the input's gradient, the weight's gradient) quantize their operands
on the fly, multiply in the low-precision type with f32 accumulation, and scale the result
back. The schemes:

- fp8: e4m3 operands forward, e5m2 incoming gradients backward, one scale per tensor from its
  current absolute maximum (current scaling).
- fp8_delayed: as fp8, each scale from the tensor's recent maxima (an amax history in the
  train state): models/low_precision_delayed.py.
- fp8_blockwise: DeepSeek-V3's fine-grained scaling: activations and gradients scale per 1 x 128
  tile of the contracted axis, weights per 128 x 128 block, and each tile's product is scaled
  and summed in f32. A square block is a block of the transposed weight too, so the input's
  gradient multiplies the same quantized weight (quantized again, not kept); the weight's
  gradient contracts tokens, so it quantizes activations and gradients in 128 x 1 tiles along
  them.
- int8: symmetric int8 with one scale per row of each operand across the contraction (per
  token for activations, per output channel for weights, per token or channel for
  gradients), as AQT trains; int32 accumulation.
- int8_stochastic: int8, the incoming gradients rounded stochastically (uniform noise in
  [-0.5, 0.5) added before rounding), so each rounded gradient is unbiased; the operands of
  the forward pass still round to the nearest value. The noise comes from the key the train
  step sets for its step (`rounding_noise`), folded with the microbatch, the layer
  (`noise_scope`) and the projection's place among the calls traced under that key; a
  gradient taken outside a train step draws from key 0.

Quantizing is straight-through: the gradient of round-to-the-grid is taken as one.
`low_precision_reference.py` defines each scheme in plain jnp; this module runs it through
qwix's quantized-training dot (the one its QtProvider calls), which keeps the operands in
their low-precision type so the backend's native fp8/int8 dot runs where it has one.
That dot tiles only the contracted axis, so fp8_blockwise's 128 x 128 weight blocks are
built here from qwix's quantized arrays and tiled dot (`_blockwise_matmul`).
Where it has none, the compiler emulates the dot with the same numbers: one logged line says
so (`announce`).
"""

import contextlib
import contextvars
import functools
import logging

import jax
import jax.numpy as jnp
# qwix's provider finds its dots by intercepting every dot_general inside flax modules (the
# attention scores too); jaxpar's projections pass one door (models/dense.py), so it calls the
# quantized-training dot itself. It lives under qwix._src: pyproject pins the version.
from qwix._src.core import dot_general as qwix_dot
from qwix._src.core import qarray
from qwix._src.core.dot_general_qt import DotGeneralQtConfig, dot_general_qt
from qwix._src.core.stochastic_rounding import get_noise_fn

from jaxpar.errors import ConfigError
from jaxpar.models import low_precision_delayed as delayed

SCHEMES = ("fp8", "fp8_delayed", "fp8_blockwise", "int8", "int8_stochastic")
BLOCK = 128  # fp8_blockwise's tile and weight block side (DeepSeek-V3's)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

log = logging.getLogger(__name__)


# The stochastic rounding scope: [its key, how many projections have drawn from it].
_NOISE = contextvars.ContextVar("rounding_noise", default=None)


@contextlib.contextmanager
def rounding_noise(key):
  """Projections traced inside draw their gradients' rounding noise from `key` (int8_stochastic)."""
  token = _NOISE.set([key, 0])
  try:
    yield
  finally:
    _NOISE.reset(token)


@contextlib.contextmanager
def noise_scope(*values):
  """Inside, the scope's key is folded with `values` (ints or traced ints: a layer's index), so
  one traced body run many times (a scan over layers or microbatches) draws new noise each time."""
  scope = _NOISE.get()
  if scope is None:
    yield
    return
  key = scope[0]
  for value in values:
    key = jax.random.fold_in(key, value)
  with rounding_noise(key):
    yield


def rounding_keys():
  """The keys of the next projection's two gradient roundings (its input's, its weight's):
  split(fold_in(scope key, i)) for the scope's i-th projection."""
  scope = _NOISE.get()
  if scope is None:
    scope = [jax.random.key(0), 0]
  key, scope[1] = jax.random.fold_in(scope[0], scope[1]), scope[1] + 1
  return tuple(jax.random.split(key))


def _tile(size: int) -> int:
  """fp8_blockwise's tile along an axis of `size`: BLOCK, or the whole axis (one scale across
  it) where BLOCK does not divide it (a narrow projection, a batch of tokens not a multiple)."""
  return BLOCK if size % BLOCK == 0 else size


def _quantized(a, qtype, tiles: dict, channels=()):
  """a as a qwix quantized array: one absmax scale per channel of `channels`, per tile of
  `tiles` ({axis: tile}), shared along every other axis."""
  return qarray.quantize(a, qarray.HowToQuantize(qtype=qtype, channelwise_axes=channels, tiled_axes=tiles))


def _weight_blocks(w):
  return _quantized(w, E4M3, {0: _tile(w.shape[0]), 1: _tile(w.shape[1])})


def _dot(a, b, contract):
  return qwix_dot.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


@jax.custom_vjp
def _blockwise_matmul(x, w):
  """x [..., K] @ w [K, N] under fp8_blockwise, in f32 (x and w in any float dtype)."""
  return _blockwise_forward(x, w)[0]


def _blockwise_forward(x, w):
  last, f32 = x.ndim - 1, jnp.float32
  tokens = _quantized(x.astype(f32), E4M3, {last: _tile(x.shape[-1])}, tuple(range(last)))
  # The residuals are the operands in their own dtype (a bf16 value is exact in f32).
  return _dot(tokens, _weight_blocks(w.astype(f32)), ((last,), (0,))), (x, w)


def _blockwise_backward(saved, g):
  x, w = saved
  last, f32 = g.ndim - 1, jnp.float32
  lead, g = tuple(range(last)), g.astype(f32)
  dx = _dot(_quantized(g, E5M2, {last: _tile(g.shape[-1])}, lead), _weight_blocks(w.astype(f32)),
            ((last,), (1,)))
  along_tokens = {last - 1: _tile(x.shape[-2])}
  dw = _dot(_quantized(x.astype(f32), E4M3, along_tokens, (last,)), _quantized(g, E5M2, along_tokens, (last,)),
            (lead, lead))
  return dx.astype(x.dtype), dw.astype(w.dtype)


_blockwise_matmul.defvjp(_blockwise_forward, _blockwise_backward)


def _config(scheme: str, ndim: int) -> DotGeneralQtConfig:
  """The qwix config of `scheme` for [...] @ [contracted, outputs] (`ndim`: the gradients'
  rank, whose every axis gets its own noise under int8_stochastic)."""
  if scheme == "fp8":
    per_tensor = dict(lhs_disable_channelwise_axes=True, rhs_disable_channelwise_axes=True,
                      dlhs_grad_disable_channelwise_axes=True, drhs_grad_disable_channelwise_axes=True)
    return DotGeneralQtConfig(lhs_qtype=E4M3, rhs_qtype=E4M3, dlhs_grad_qtype=E5M2,
                              drhs_grad_qtype=E5M2, **per_tensor)
  if scheme == "int8":
    return DotGeneralQtConfig(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8, dlhs_grad_qtype=jnp.int8,
                              drhs_grad_qtype=jnp.int8)
  if scheme == "int8_stochastic":
    noise = [get_noise_fn("uniform", key, tuple(range(ndim))) for key in rounding_keys()]
    return DotGeneralQtConfig(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8, dlhs_grad_qtype=jnp.int8,
                              drhs_grad_qtype=jnp.int8, dlhs_stochastic_rounding_noise_fn=noise[0],
                              drhs_stochastic_rounding_noise_fn=noise[1])
  raise ValueError(f"unknown train precision {scheme!r}: one of {', '.join(SCHEMES)}")


def low_precision_matmul(x, w, scheme: str, history=None):
  """x [..., K] @ w [K, N] -> [..., N] in x's dtype, under `scheme` (one of SCHEMES;
  fp8_delayed: scaled from `history`, the projection's AmaxHistory, which it updates).

  The operands enter in f32: qwix accumulates in its operands' scale type, which would be
  bf16 for a bf16 model, and each scheme accumulates in f32. The quantized values are the
  same (a bf16 value is exact in f32); only the scales and the sums are wider."""
  announce(scheme)
  if scheme == "fp8_delayed":
    return _delayed(x, w, history)
  if scheme == "fp8_blockwise":
    return _blockwise_matmul(x, w).astype(x.dtype)
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  f32 = jnp.float32
  return dot_general_qt(x.astype(f32), w.astype(f32), dims, _config(scheme, x.ndim)).astype(x.dtype)


def _delayed(x, w, history):
  if history is None:
    raise ConfigError("model.train_precision=fp8_delayed needs a scaling history this projection does not "
                      "keep: train with model.train_precision=fp8")
  f32 = jnp.float32
  y, rows = delayed.delayed_matmul(x.astype(f32), w.astype(f32), history[...])
  history[...] = history[...].at[:2].set(rows)
  return y.astype(x.dtype)


def native(scheme: str, device) -> bool:
  """Whether `device` multiplies the scheme's operands in their own type (else the compiler
  emulates it: same numbers, no speed-up). fp8 tensor cores: NVIDIA compute capability 8.9+
  (Ada, Hopper, Blackwell). int8: NVIDIA tensor cores, and the TPU v5e/v5p/v6e matrix units."""
  if device.platform == "gpu":
    capability = tuple(int(c) for c in getattr(device, "compute_capability", "0.0").split("."))
    return scheme.startswith("int8") or capability >= (8, 9)
  if device.platform == "tpu":
    kind = device.device_kind.lower()
    return scheme.startswith("int8") and any(v in kind for v in ("v5", "v6"))
  return False


def announce(scheme: str) -> None:
  """Log once per scheme and device kind whether its dots run natively or emulated, for the
  devices of the mesh being traced for (a TPU topology compiled for on a CPU host, say)."""
  target = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  local = jax.devices()[0]  # a real device: it knows its compute capability
  device = local if target is None or target.platform == local.platform else target
  if not native(scheme, device):
    _say_emulated(scheme, device.device_kind)


@functools.cache
def _say_emulated(scheme: str, device_kind: str) -> None:
  log.warning("model.train_precision=%s: %s has no %s matmul units that jaxpar knows of, so the "
              "compiler emulates the dots: the same numbers, without the speed-up", scheme,
              device_kind, "fp8" if scheme.startswith("fp8") else "int8")
