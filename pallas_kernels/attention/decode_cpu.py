"""Paged decode attention on CPU: a C++ kernel (decode_cpu.cc, an XLA FFI custom call) that
reads each row's keys and values in place from the stacked page pool.

XLA's own form (decode_xla.py) gathers every row's pages into a contiguous copy per layer
and step and multiplies them in many tiny batched dots. The kernel reads each key and
value once, in one pass with an online softmax: the bench-20m batch-32 decode step took
8.46 against 10.22 ms with XLA's form (10th percentiles of 300 alternating calls of the
engine's compiled step; `benchmarks/decode_floor.py` shows both in whole generations).
Like the Pallas decode kernels, it reads a layer of the pool stacked over layers by the
layer's index (`decode_common.stacked_inputs`). Same function as
`decode_attention_reference`, to float rounding (tests compare them).

`available()` says whether the kernel can run here (native.load builds it on first use);
where it cannot, the dispatch keeps XLA's form.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.pallas_kernels import native
from jaxpar.pallas_kernels.attention import decode_common
from jaxpar.pallas_kernels.attention.spec import AttentionSpec

_SOURCE = Path(__file__).with_name("decode_cpu.cc")
_TARGET = "JaxparPagedDecodeAttention"
DTYPES = (jnp.float32, jnp.bfloat16)


def available(q_dtype, cache_dtype) -> bool:
  """Whether queries and pages of these dtypes can take the kernel in this process (both
  float32 or both bfloat16)."""
  return (native.enabled() and jnp.dtype(q_dtype) == jnp.dtype(cache_dtype) and jnp.dtype(q_dtype) in DTYPES
          and native.load(_SOURCE, (_TARGET,)))


def paged_decode_attention_cpu(q, k_pages, v_pages, lengths, page_table, spec: AttentionSpec = AttentionSpec(), *,
                               layer=None, sinks=None):
  """q [B, Hq, D]; k pages [Hkv, num_pages, page_size, D], v pages [.., Dv] or None with
  spec.value_dim (the keys' first entries: a latent cache); with `layer` (an int scalar) both
  stacked over layers [layers, Hkv, ...] and that layer's read; lengths [B] (the new
  token's key included); page_table [B, n]; sinks [Hq] or None -> [B, Hq, Dv] in q's dtype
  (the pages' too: `available`); length 0 gets 0."""
  if not native.load(_SOURCE, (_TARGET,)):
    raise RuntimeError("the CPU decode attention kernel could not be built here (the warning above says why); "
                       "pallas_kernels.decode_attention falls back to XLA's form by itself")
  k_pages, v_pages, layer, value_dim = decode_common.stacked_inputs(q, k_pages, v_pages, lengths, page_table, layer,
                                                                    spec.value_dim, sinks)
  batch, q_heads, head_dim = q.shape
  values = k_pages if v_pages is None else v_pages
  call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct((batch, q_heads, value_dim), q.dtype),
                          vmap_method="sequential")
  return call(q, k_pages, values, layer, lengths.astype(jnp.int32),
              page_table.astype(jnp.int32),
              jnp.zeros((q_heads,), jnp.float32) if sinks is None else sinks.astype(jnp.float32),
              scale=np.float32(spec.scale_for(head_dim)),
              sliding_window=np.int64(spec.sliding_window or 0), soft_cap=np.float32(spec.logit_soft_cap or 0.0),
              value_dim=np.int64(value_dim), has_sinks=sinks is not None)
