"""Projections written as one 2-D matmul over all tokens."""

import math


def dense(x, kernel, *, contract: int = 1):
  """Contract the last `contract` dims of x with the first `contract` dims of kernel.

  [B, L, ...in] x [...in, ...out] -> [B, L, ...out], computed as [B*L, in] @ [in, out]:
  the same math as an einsum, but XLA's CPU backend runs this form, and its gradients,
  about 2.5x faster than the contraction over [B, L, ...] (measured on the MLP of
  bench-20m). The reshapes are free on every backend.
  """
  lead = x.shape[:x.ndim - contract]
  n_in = math.prod(kernel.shape[:contract])
  out = kernel.shape[contract:]
  y = x.reshape(math.prod(lead), n_in) @ kernel.reshape(n_in, math.prod(out))
  return y.reshape(*lead, *out)
