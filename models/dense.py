"""Projections: one 2-D matmul over all tokens, on a float or a quantized kernel.

A projection's weight is created by `projection(...)`: an `nnx.Param` for a float model
(its parameter path is the layer attribute itself, e.g. `layers.attn.q`, as checkpoints and
the Hugging Face mappings expect), or a `QuantizedKernel` module that owns integer values,
scales and zero points under that path (`layers.attn.q.values`, `.scales`, `.zeros`), each
with logical axis names derived from the float kernel's, so it shards like the original.
`dense(x, kernel)` runs either.
"""

import math

import jax.numpy as jnp
from flax import nnx

from jaxpar import pallas_kernels
from jaxpar.mesh import num_shards
from jaxpar.models.low_precision import low_precision_matmul

# The activation-side name of a parameter axis: what the quantized matmul's shard_map splits.
_ACTIVATION_NAME = {"heads": "act_heads", "kv_heads": "act_kv_heads", "mlp": "act_mlp",
                    "vocab": "act_vocab"}


class QuantizedKernel(nnx.Module):
  """A projection kernel [*in_dims, *out_dims] stored quantized (model.quantization).

  values: int8, the float kernel's shape (int4: the last in-dim halved, two per byte);
  scales: f32 [*out_dims] (int8, w8a8: per output channel) or
  [*in_dims[:-1], in_dims[-1] / group, *out_dims] (int4); zeros: as scales (int4 asymmetric).
  """

  def __init__(self, kernel, names, contract: int, quantization):
    q = quantization
    self.mode, self.group_size, self.contract = q.mode, q.group_size, contract
    self.out_shape = tuple(kernel.shape[contract:])
    in_names, out_names = tuple(names[:contract]), tuple(names[contract:])
    self.names = (_ACTIVATION_NAME.get(in_names[0]), _ACTIVATION_NAME.get(out_names[0]))
    self.implementation, self.outlier_channels = q.implementation, q.outlier_channels
    arrays = quantized_arrays(kernel, contract, q)
    scale_names = in_names + out_names if q.mode == "int4" else out_names
    self.values = nnx.Param(arrays["values"], out_sharding=names)
    self.scales = nnx.Param(arrays["scales"], out_sharding=scale_names)
    self.zeros = nnx.Param(arrays["zeros"], out_sharding=scale_names) if "zeros" in arrays else None

  def weight(self) -> pallas_kernels.QuantizedWeight:
    """The 2-D [K, N] view the matmul kernels read (reshapes only: no copy)."""
    n = math.prod(self.out_shape)
    flat = lambda p: None if p is None else p[...].reshape(-1, n)
    return pallas_kernels.QuantizedWeight(flat(self.values), flat(self.scales), flat(self.zeros),
                                          mode=self.mode, group_size=self.group_size)

  def __call__(self, x):
    lead = x.shape[:x.ndim - self.contract]
    y = pallas_kernels.quantized_matmul(
        x.reshape(*lead, -1), self.weight(), names=self.names, implementation=self.implementation,
        outlier_channels=self.outlier_channels)
    return y.reshape(*lead, *self.out_shape)


def quantized_arrays(kernel, contract: int, quantization) -> dict:
  """A float kernel [*in_dims, *out_dims] -> the arrays a QuantizedKernel stores:
  {"values", "scales"} (+ "zeros"), shaped as its docstring says."""
  q = quantization
  in_shape, out_shape = kernel.shape[:contract], kernel.shape[contract:]
  w = pallas_kernels.quantize_weight(kernel.reshape(math.prod(in_shape), -1), q.mode, q.group_size,
                                     zero_point=q.zero_point)
  if q.mode != "int4":
    return {"values": w.values.reshape(kernel.shape), "scales": w.scales.reshape(out_shape)}
  grouped = (*in_shape[:-1], in_shape[-1] // q.group_size, *out_shape)
  arrays = {"values": w.values.reshape(*in_shape[:-1], in_shape[-1] // 2, *out_shape),
            "scales": w.scales.reshape(grouped)}
  if w.zeros is not None:
    arrays["zeros"] = w.zeros.reshape(grouped)
  return arrays


def projection(init, key, shape, names, *, param_dtype, quantization=None, contract: int = 1):
  """A projection weight: nnx.Param(init(key, shape)) with logical `names`, or with
  `quantization` (model.quantization) that kernel quantized into a QuantizedKernel."""
  value = init(key, shape, param_dtype)
  if quantization is None:
    # `contract` travels as metadata so an adapter (models/lora.py) can read the layout.
    return nnx.Param(value, out_sharding=names, contract=contract)
  return QuantizedKernel(value, names, contract, quantization)


def dense(x, kernel, *, contract: int = 1, dtype=None, adapter=None, precision="compute_dtype", history=None):
  """Contract the last `contract` dims of x with the first `contract` dims of kernel, plus
  the low-rank term of `adapter` (a models/lora.py LoRA) when given. A float kernel's matmul
  runs in `precision` (model.train_precision: models/low_precision.py; fp8_delayed reads and
  writes the projection's `history`, an AmaxHistory).

  kernel: an array, an nnx.Param (cast to `dtype` when given) or a QuantizedKernel.
  [B, L, ...in] x [...in, ...out] -> [B, L, ...out], computed as [B*L, in] @ [in, out]:
  the same math as an einsum, but XLA's CPU backend runs this form, and its gradients,
  about 2.5x faster than the contraction over [B, L, ...] (measured on the MLP of
  bench-20m). The reshapes are free on every backend. When the mesh splits the tokens'
  length (context or sequence parallelism) as well as the batch, B*L would interleave
  the two splits, which XLA can only undo by gathering: then the contraction keeps B, L.
  """
  if isinstance(kernel, QuantizedKernel):
    y = kernel(x)
  else:
    y = _float_dense(x, kernel, contract, dtype, precision, history)
  return y if adapter is None else y + adapter(x, dtype)


def _float_dense(x, kernel, contract, dtype, precision, history):
  kernel = kernel[...] if dtype is None else kernel[...].astype(dtype)
  lead = x.shape[:x.ndim - contract]
  n_in = math.prod(kernel.shape[:contract])
  out = kernel.shape[contract:]
  flat = kernel.reshape(n_in, math.prod(out))
  if precision != "compute_dtype":
    matmul = lambda a, b: low_precision_matmul(a, b, precision, history)  # noqa: E731
  else:
    matmul = lambda a, b: jnp.tensordot(a, b, axes=1)  # noqa: E731
  if num_shards("residual_length") > 1:
    return matmul(x.reshape(*lead, n_in), flat).reshape(*lead, *out)
  return matmul(x.reshape(math.prod(lead), n_in), flat).reshape(*lead, *out)
