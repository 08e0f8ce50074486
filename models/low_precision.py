"""Projection matmuls in fp8 or int8 while training (`model.train_precision`).

The weights stay float (param_dtype) and the optimizer sees float gradients: each projection's
three matmuls (forward, the input's gradient, the weight's gradient) quantize their operands
on the fly, multiply in the low-precision type with f32 accumulation, and scale the result
back. The schemes:

- fp8: e4m3 operands forward, e5m2 incoming gradients backward, one scale per tensor from its
  current absolute maximum (current scaling).
- fp8_blockwise: DeepSeek-V3's fine-grained scaling: every operand is scaled per 128-long
  tile of the contracted axis (activations and gradients in 1 x 128 tiles, weights in
  128 x 1 tiles of each output column) and each tile's product is scaled and summed in f32.
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
from qwix._src.core.dot_general_qt import DotGeneralQtConfig, dot_general_qt
from qwix._src.core.stochastic_rounding import get_noise_fn

SCHEMES = ("fp8", "fp8_blockwise", "int8", "int8_stochastic")
BLOCK = 128  # fp8_blockwise's tile along the contraction (DeepSeek-V3's)

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


def _tile(size: int) -> int | None:
  """fp8_blockwise's tile along an axis of `size`: BLOCK, or the whole axis (one scale per row)
  where BLOCK does not divide it (a narrow projection, a batch of tokens not a multiple)."""
  return BLOCK if size % BLOCK == 0 else None


def _config(scheme: str, contracted: int, outputs: int, tokens: int, ndim: int) -> DotGeneralQtConfig:
  """The qwix config of `scheme` for [..., tokens, contracted] @ [contracted, outputs]
  (`tokens`: the last axis the weight gradient contracts, which fp8_blockwise tiles; `ndim`:
  the gradients' rank, whose every axis gets its own noise under int8_stochastic)."""
  e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
  if scheme == "fp8":
    per_tensor = dict(lhs_disable_channelwise_axes=True, rhs_disable_channelwise_axes=True,
                      dlhs_grad_disable_channelwise_axes=True, drhs_grad_disable_channelwise_axes=True)
    return DotGeneralQtConfig(lhs_qtype=e4m3, rhs_qtype=e4m3, dlhs_grad_qtype=e5m2,
                              drhs_grad_qtype=e5m2, **per_tensor)
  if scheme == "fp8_blockwise":
    # Tiled operands cannot be reused across the backward's other contraction: the backward
    # requantizes the saved float operands in tiles of its own contracted axis.
    return DotGeneralQtConfig(lhs_qtype=e4m3, rhs_qtype=e4m3, tile_size=_tile(contracted),
                              dlhs_grad_qtype=e5m2, drhs_grad_qtype=e5m2, dlhs_tile_size=_tile(outputs),
                              drhs_tile_size=_tile(tokens), use_original_residuals=True,
                              dlhs_residual_qtype=e4m3, drhs_residual_qtype=e4m3)
  if scheme == "int8":
    return DotGeneralQtConfig(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8, dlhs_grad_qtype=jnp.int8,
                              drhs_grad_qtype=jnp.int8)
  if scheme == "int8_stochastic":
    noise = [get_noise_fn("uniform", key, tuple(range(ndim))) for key in rounding_keys()]
    return DotGeneralQtConfig(lhs_qtype=jnp.int8, rhs_qtype=jnp.int8, dlhs_grad_qtype=jnp.int8,
                              drhs_grad_qtype=jnp.int8, dlhs_stochastic_rounding_noise_fn=noise[0],
                              drhs_stochastic_rounding_noise_fn=noise[1])
  raise ValueError(f"unknown train precision {scheme!r}: one of {', '.join(SCHEMES)}")


def low_precision_matmul(x, w, scheme: str):
  """x [..., K] @ w [K, N] -> [..., N] in x's dtype, under `scheme` (one of SCHEMES).

  The operands enter in f32: qwix accumulates in its operands' scale type, which would be
  bf16 for a bf16 model, and each scheme accumulates in f32. The quantized values are the
  same (a bf16 value is exact in f32); only the scales and the sums are wider."""
  announce(scheme)
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  config = _config(scheme, w.shape[0], w.shape[1], x.shape[-2], x.ndim)
  f32 = jnp.float32
  return dot_general_qt(x.astype(f32), w.astype(f32), dims, config).astype(x.dtype)


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
