"""The entry points models call for attention; each picks an implementation.

implementation: "auto" | "flash" | "reference" | "chunked" (the config's `attention`).
  auto       TPU/GPU: the flash kernel (head_dim 64/128/256), else chunked.
             CPU: the reference for short keys (fastest there), chunked beyond.
  flash      the Pallas kernel for the backend; on CPU the TPU kernel in interpret mode.
  reference  pure jnp, materialises [Lq, Lk] logits.
  chunked    XLA loops with online softmax: O(L) memory, any head_dim, any backend.
Kernels run per device inside `jax.shard_map` over the current mesh.
"""

import functools

from jaxpar.pallas_kernels import sharding, validation
from jaxpar.pallas_kernels.block_sizes import default_block_sizes
from jaxpar.pallas_kernels.chunked import chunked_attention
from jaxpar.pallas_kernels.decode_gpu import paged_decode_attention_gpu
from jaxpar.pallas_kernels.decode_tpu import paged_decode_attention_tpu
from jaxpar.pallas_kernels.flash_gpu import flash_attention_gpu
from jaxpar.pallas_kernels.flash_tpu import flash_attention_tpu
from jaxpar.pallas_kernels.reference import attention_reference, decode_attention_reference

IMPLEMENTATIONS = ("auto", "flash", "reference", "chunked")
# On CPU the one-shot reference beats the loops up to about this many keys.
CPU_REFERENCE_MAX_KV_LEN = 1024


def _check_implementation(implementation):
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation={implementation!r} is not one of {IMPLEMENTATIONS}")


def choose_implementation(implementation, platform, head_dim, kv_len):
  """What `implementation` resolves to for this backend and shape."""
  _check_implementation(implementation)
  if implementation != "auto":
    return implementation
  if platform in ("tpu", "gpu"):
    return "flash" if head_dim in validation.SUPPORTED_HEAD_DIMS else "chunked"
  return "reference" if kv_len <= CPU_REFERENCE_MAX_KV_LEN else "chunked"


def attention(q, k, v, *, causal=True, segment_ids=None, sliding_window=None,
              logit_soft_cap=None, scale=None, implementation="auto", block_sizes=None):
  """q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] -> [B, Lq, Hq, D].

  Hq % Hkv == 0 (GQA/MQA); segment_ids: int [B, Lk] for packed sequences (queries are
  the last Lq positions); sliding_window: keys at most this far back (incl. self);
  logit_soft_cap: cap * tanh(logits / cap); block_sizes: kernel tiles (BlockSizes).
  """
  platform = sharding.current_platform()
  impl = choose_implementation(implementation, platform, q.shape[-1], k.shape[1])
  options = dict(causal=causal, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                 scale=scale)
  if impl == "reference":
    validation.check_attention_args(q, k, v, segment_ids, sliding_window, logit_soft_cap,
                                    head_dims=None)
    return attention_reference(q, k, v, segment_ids=segment_ids, **options)
  if impl == "chunked":
    return chunked_attention(q, k, v, segment_ids=segment_ids, block_sizes=block_sizes, **options)
  validation.check_attention_args(q, k, v, segment_ids, sliding_window, logit_soft_cap)
  kernel = flash_attention_gpu if platform == "gpu" else flash_attention_tpu
  blocks = block_sizes or default_block_sizes(platform, sharding.current_device_kind())
  run = functools.partial(kernel, block_sizes=blocks, interpret=platform not in ("tpu", "gpu"),
                          **options)
  return sharding.shard_over_mesh(lambda q, k, v, seg: run(q, k, v, segment_ids=seg),
                                  (q, k, v, segment_ids), ((0, 2), (0, 2), (0, 2), (0, None)))


def decode_attention(q, k_cache, v_cache, lengths, *, page_table=None, sliding_window=None,
                     logit_soft_cap=None, scale=None, implementation="auto"):
  """One new token per sequence against a KV cache with ragged `lengths` -> [B, Hq, D].

  q: [B, Hq, D]; lengths: int [B] valid entries (the new token's key included).
  Contiguous cache: k/v [B, S, Hkv, D]; always the XLA path (a bandwidth-bound
  matrix-vector product). Paged cache: k/v [Hkv, num_pages, page_size, D] with
  page_table int [B, pages_per_seq]; "auto"/"flash" use the Pallas kernel on
  TPU/GPU ("flash" on CPU: the TPU kernel in interpret mode).
  """
  _check_implementation(implementation)
  platform = sharding.current_platform()
  options = dict(sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, scale=scale)
  use_kernel = page_table is not None and (
      implementation == "flash" or (implementation == "auto" and platform in ("tpu", "gpu")))
  if not use_kernel:
    return decode_attention_reference(q, k_cache, v_cache, lengths, page_table=page_table,
                                      **options)
  kernel = paged_decode_attention_gpu if platform == "gpu" else paged_decode_attention_tpu
  run = functools.partial(kernel, interpret=platform not in ("tpu", "gpu"), **options)
  return sharding.shard_over_mesh(
      run, (q, k_cache, v_cache, lengths, page_table),
      ((0, 1), (None, 0), (None, 0), (0, None), (0, None)))
