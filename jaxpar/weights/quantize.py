"""Quantized weights from float ones: every projection kernel the quantized model holds
(attention q/k/v/o, MLP gate/up/down: `models/dense.py`), the rest (embeddings, norms)
copied unchanged, on the quantized runtime's shardings. `jaxpar quantize` writes them as a
checkpoint (convert/quantize.py); QLoRA quantizes its base on load."""

import jax
from flax import nnx

from jaxpar.models.dense import QuantizedKernel, quantized_arrays
from jaxpar.runtime import Runtime


def quantized_kernels(runtime: Runtime) -> list[tuple[tuple[str, ...], QuantizedKernel]]:
  """(parameter path, abstract QuantizedKernel) of every quantized projection of a model."""
  module = runtime.merge(runtime.abstract_params, runtime.abstract_model_state)
  return [(tuple(path), node) for path, node in nnx.iter_modules(module)
          if isinstance(node, QuantizedKernel)]


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def quantize_params(params: dict, quant_runtime: Runtime, shardings=None) -> dict:
  """Float params (a nested dict) -> the quantized model's params, placed on its shardings
  (or `shardings`: those of just the params given, e.g. a base without its adapters).
  Stacked layers are quantized one layer at a time (vmap over the leading axes)."""
  kernels = quantized_kernels(quant_runtime)
  config = quant_runtime.model_config.quantization

  def convert(params):
    out = jax.tree.map(lambda x: x, params)  # a fresh tree of the same arrays
    for path, kernel in kernels:
      w = _get(params, path)
      stacked = w.ndim - kernel.contract - len(kernel.out_shape)
      fn = lambda w, c=kernel.contract: quantized_arrays(w, c, config)
      for _ in range(stacked):
        fn = jax.vmap(fn)
      _get(out, path[:-1])[path[-1]] = fn(w)
    return out

  with quant_runtime.context():
    return jax.jit(convert, out_shardings=shardings or quant_runtime.param_shardings)(params)
