"""The one matmul the TPU kernels use."""

import jax.numpy as jnp
from jax import lax


def mxu_dot(a, b, *, trans_b=False):
  """a @ b (or a @ b.T) accumulated in float32, or int32 for integer (int8) operands.

  Low-precision operands run at the MXU's native precision whatever
  jax_default_matmul_precision says: Mosaic rejects 'highest' for bf16 and int8.
  """
  precision = None if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  acc = jnp.int32 if jnp.issubdtype(a.dtype, jnp.integer) else jnp.float32
  dims = (((1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=acc)
