"""The one door for quantized matmuls: `quantized_matmul(x, weight)`.

implementation: "auto" | "pallas" | "xla".
  auto    TPU: the Mosaic kernel; GPU: the Triton kernel; CPU: xla.
  pallas  the backend's kernel (on CPU: the TPU kernel in interpret mode).
  xla     the reference: dequantize + dot (W8A8: an int8 x int8 -> int32 dot), partitioned
          by XLA like any matmul; the weights stay small at rest.
Kernels run per device through `jaxpar.mesh.logical_shard_map`: `names` says which logical
axes K and N carry, so a column-parallel weight (N split) computes its columns locally and
a row-parallel one (K split) sums its partial products across devices.
"""

import functools
import math

import jax

from jaxpar.errors import ConfigError, UserError
from jaxpar.mesh import logical_shard_map
from jaxpar.pallas_kernels.matmul import reference
from jaxpar.pallas_kernels.matmul.format import QuantizedWeight, check_weight
from jaxpar.pallas_kernels.matmul.gpu import quantized_matmul_gpu
from jaxpar.pallas_kernels.matmul.quantize import quantize_rows
from jaxpar.pallas_kernels.matmul.tpu import quantized_matmul_tpu
from jaxpar.pallas_kernels.platform import current_platform, interpret

IMPLEMENTATIONS = ("auto", "pallas", "xla")


def choose_implementation(implementation: str, platform: str) -> str:
  if implementation not in IMPLEMENTATIONS:
    raise ConfigError(f"quantized matmul implementation={implementation!r} is not one of "
                     f"{IMPLEMENTATIONS}")
  if implementation != "auto":
    return implementation
  return "pallas" if platform in ("tpu", "gpu") else "xla"


def _check(x, w: QuantizedWeight, outlier_channels: int):
  check_weight(w)
  k = w.shape[0]
  if x.shape[-1] != k:
    raise UserError(f"x has {x.shape[-1]} input features (last dim of shape {x.shape}) but the "
                     f"weight has K={k}")
  if outlier_channels and (w.mode != "w8a8" or not 0 < outlier_channels < k):
    raise UserError(f"outlier_channels={outlier_channels} needs mode='w8a8' and 0 < it < K={k}")


def _varying_alike(arrays):
  """Per device, activations vary over the batch axes and weights over the tensor axis;
  the kernel's dot wants both to vary over the same mesh axes."""
  vma = lambda a: jax.typeof(a).mat.varying
  axes = frozenset().union(*(vma(a) for a in arrays if a is not None))
  return [a if a is None or not axes - vma(a)
          else jax.lax.pcast(a, tuple(sorted(axes - vma(a))), to="varying") for a in arrays]


def quantized_matmul(x, w: QuantizedWeight, *, names=(None, None), implementation="auto",
                     block_sizes=None, outlier_channels: int = 0):
  """x [..., K] @ weight [K, N] -> [..., N] in x's dtype.

  names: logical names of (K, N), e.g. ("act_mlp", None) for a row-parallel MLP down
  projection; rows (tokens) are "batch". outlier_channels (W8A8 only): this many input
  channels with the largest |x| are kept in float, the rest quantized per token.
  """
  _check(x, w, outlier_channels)
  platform = current_platform()
  impl = choose_implementation(implementation, platform)
  lead, (k, n) = x.shape[:-1], w.shape
  x2 = x.reshape(math.prod(lead), k)
  extra, x_scales = 0.0, None
  if w.mode == "w8a8":
    if outlier_channels:
      main, index = reference.outlier_columns(x2, outlier_channels)
      extra = reference.outlier_product(x2, index, w)
    else:
      main = x2
    x2, x_scales = quantize_rows(main)
  if impl == "xla":
    y = (reference.w8a8_reference(x2, x_scales, w) if w.mode == "w8a8"
         else reference.weight_only_reference(x2, w))
  else:
    kernel = quantized_matmul_gpu if platform == "gpu" else quantized_matmul_tpu
    interpreted = interpret(platform)
    run = functools.partial(kernel, blocks=block_sizes, interpret=interpreted)
    k_name, n_name = names
    scale_names = (k_name, n_name) if w.mode == "int4" else (None, n_name)  # per group | channel

    def per_device(*arrays):
      x2, x_scales, values, scales, zeros = _varying_alike(arrays)
      local = QuantizedWeight(values, scales, zeros, mode=w.mode, group_size=w.group_size)
      return run(x2, local, x_scales)

    y = logical_shard_map(per_device,
                          (("batch", k_name), ("batch", None), (k_name, n_name), scale_names,
                           scale_names),
                          ("batch", n_name), sum_over=(k_name,) if k_name else (),
                          # Pallas' interpreter starts outputs as mesh-invariant values, which
                          # the varying-axes check rejects once a kernel accumulates into them.
                          check_vma=not interpreted)(
                              x2, x_scales, w.values, w.scales, w.zeros)
  return (y + extra).astype(x.dtype).reshape(*lead, n)
