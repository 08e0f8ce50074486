"""The entry points models call for attention; each takes the call's AttentionSpec (spec.py)
and picks an implementation.

spec.implementation: "auto" | "flash" | "reference" | "chunked" (the config's `attention`).
  auto       TPU/GPU: the flash kernel (head_dim 64/128/256), else chunked.
             CPU: the reference for short keys (fastest there), chunked beyond.
  flash      the Pallas kernel for the backend; on CPU the TPU kernel in interpret mode.
  reference  pure jnp, materialises [Lq, Lk] logits.
  chunked    XLA loops with online softmax: O(L) memory, any head_dim, any backend.
Kernels run per device inside `jax.shard_map` over the current mesh. When the mesh splits
the sequence length (mesh.context > 1), `context_parallel` picks all-gather or ring
attention around the same kernels (context_parallel.py); by default the one the runtime's
parallel plan set (`mesh.execution_options`).
"""

import functools

import jax
import jax.numpy as jnp

from jaxpar.errors import ConfigError, UserError
from jaxpar.mesh import current_execution_options, logical_shard_map
from jaxpar.pallas_kernels.attention import context_parallel as cp
from jaxpar.pallas_kernels.attention import decode_cpu, validation
from jaxpar.pallas_kernels.attention.decode_common import visible_pages
from jaxpar.pallas_kernels.attention.block_sizes import default_block_sizes
from jaxpar.pallas_kernels.attention.chunked import chunked_attention
from jaxpar.pallas_kernels.attention.decode_gpu import paged_decode_attention_gpu
from jaxpar.pallas_kernels.attention.decode_tpu import Int8Pages, paged_decode_attention_tpu
from jaxpar.pallas_kernels.attention.decode_xla import paged_decode_attention_xla
from jaxpar.pallas_kernels.attention.flash_gpu import flash_attention_gpu
from jaxpar.pallas_kernels.attention.flash_tpu import flash_attention_tpu
from jaxpar.pallas_kernels.attention.reference import (attention_reference, decode_attention_reference,
                                                       paged_attention_reference)
from jaxpar.pallas_kernels.attention.spec import AttentionSpec, TreeMask
from jaxpar.pallas_kernels.platform import current_device_kind, current_platform, interpret

# On CPU the one-shot reference beats the loops up to about this many keys.
CPU_REFERENCE_MAX_KV_LEN = 1024
# Logical names of the kernels' arguments. Query and key/value heads share one name so
# both are split over the same mesh axes (or neither): contiguous head blocks keep every
# query head with its kv head under GQA.
_HEADS = "act_kv_heads"
_SEQUENCE = ("batch", None, _HEADS, "head_dim")  # [B, L, H, D]; length whole per device
_PAGES = (_HEADS, None, None, "head_dim")  # [Hkv, num_pages, page_size, D]; pages shared


def choose_implementation(implementation, platform, head_dim, kv_len, value_dim=None, device_kind=""):
  """What `implementation` resolves to for this backend, chip and shape (value_dim: the
  values' head dim when it differs from the queries' and keys')."""
  if implementation != "auto":
    return implementation
  if platform in ("tpu", "gpu"):
    dims = {head_dim, value_dim or head_dim}
    return "flash" if dims <= set(validation.flash_head_dims(platform, device_kind)) else "chunked"
  return "reference" if kv_len <= CPU_REFERENCE_MAX_KV_LEN else "chunked"


def _for_kernels(spec, platform, head_dim):
  """The spec as a Pallas kernel runs it here: the backend's tiles, interpret mode off TPU/GPU."""
  return spec.replace(block_sizes=spec.block_sizes or default_block_sizes(platform, current_device_kind(), head_dim),
                      interpret=interpret(platform))


def attention(q, k, v, spec: AttentionSpec = AttentionSpec(), *, segment_ids=None, sinks=None,
              context_parallel=None, zigzag=False):
  """q: [B, Lq, Hq, D]; k: [B, Lk, Hkv, D]; v: [B, Lk, Hkv, Dv] -> [B, Lq, Hq, Dv].

  Dv may differ from D (multi-head latent attention). Hq % Hkv == 0 (GQA/MQA);
  segment_ids: int [B, Lk] for packed sequences (queries are the last Lq positions);
  sinks: [Hq] logits, one per query head, that join each row's softmax with a zero value
  (GPT-OSS; differentiable). On a mesh that splits `length`: context_parallel "all_gather"
  | "ring" (None: the current execution options'); zigzag: the length axis is in zig-zag
  order (layout.zigzag), else contiguous.
  """
  if isinstance(spec.mask, TreeMask):
    raise UserError("a tree mask is for paged attention over a pass's new tokens (speculative decoding's tree "
                    "pass): call paged_attention")
  platform = current_platform()
  split = cp.length_split(zigzag)
  if split is not None:
    strategy = context_parallel or current_execution_options().context_attention
    return _context_parallel(q, k, v, segment_ids, sinks, split, platform, strategy, spec)
  impl = choose_implementation(spec.implementation, platform, q.shape[-1], k.shape[1], v.shape[-1],
                               current_device_kind())
  if impl == "reference":
    validation.check_attention_args(q, k, v, segment_ids, head_dims=None, sinks=sinks)
    return attention_reference(q, k, v, spec, segment_ids=segment_ids, sinks=sinks)
  if impl == "chunked":
    return chunked_attention(q, k, v, spec, segment_ids=segment_ids, sinks=sinks)
  validation.check_attention_args(q, k, v, segment_ids, sinks=sinks,
                                  head_dims=validation.flash_head_dims(platform, current_device_kind()))
  kernel = flash_attention_gpu if platform == "gpu" else flash_attention_tpu
  spec = _for_kernels(spec, platform, q.shape[-1])
  return logical_shard_map(lambda q, k, v, seg, sinks: kernel(q, k, v, spec, segment_ids=seg, sinks=sinks),
                           (_SEQUENCE, _SEQUENCE, _SEQUENCE, ("batch", None), (_HEADS,)),
                           _SEQUENCE)(q, k, v, segment_ids, sinks)


def _context_parallel(q, k, v, segment_ids, sinks, split, platform, strategy, spec):
  """Per-piece kernel: flash where the spec's implementation resolves to it, else chunked."""
  cp.check_split(split, q, k, strategy, spec.implementation)
  impl = choose_implementation(spec.implementation, platform, q.shape[-1], k.shape[1], v.shape[-1],
                               current_device_kind())
  if impl == "flash" and interpret(platform):
    raise ConfigError(f"attention implementation 'flash' runs in interpret mode on {platform}, "
                     "which JAX cannot run with per-device offsets inside shard_map: use "
                     "'chunked' or 'auto' when the mesh splits the sequence length")
  head_dims = validation.flash_head_dims(platform, current_device_kind()) if impl == "flash" else None
  validation.check_attention_args(q, k, v, segment_ids, head_dims=head_dims, sinks=sinks)
  if impl == "flash":
    spec = _for_kernels(spec, platform, q.shape[-1])
  return cp.context_parallel_attention(q, k, v, segment_ids, sinks, split=split, strategy=strategy,
                                       kernel=cp.blockwise_kernel(impl, platform), spec=spec)


def decode_attention(q, k_cache, v_cache, lengths, spec: AttentionSpec = AttentionSpec(), *, page_table=None,
                     layer=None, sinks=None):
  """One new token per sequence against a KV cache with ragged `lengths` -> [B, Hq, Dv].

  q: [B, Hq, D]; lengths: int [B] valid entries (the new token's key included).
  Contiguous cache: k [B, S, Hkv, D], v [B, S, Hkv, Dv]; always the XLA path (a
  bandwidth-bound matrix-vector product). Paged cache: k [Hkv, num_pages, page_size, D],
  v [.., Dv] with page_table int [B, pages_per_seq]; with `layer` (an int scalar) the pages
  are stacked over layers [layers, Hkv, ...] and that layer's are read. "auto"/"flash" use
  the Pallas kernel on TPU/GPU ("flash" on CPU: the TPU kernel in interpret mode); "auto"
  on CPU the C++ kernel that reads pages in place (decode_cpu.py), or where it cannot run,
  the transpose-free XLA form (decode_xla.py). With a sliding window every implementation
  gets only the pages inside it (`visible_pages`). v_cache None: the values are the first
  spec.value_dim entries of each key (multi-head latent attention's latent cache, absorbed
  form: queries [B, Hq, latent + rope] against one latent "kv head"). sinks: [Hq] or
  None, as `attention` takes them.
  """
  validation.check_sinks(sinks, q.shape[1])
  platform = current_platform()
  if page_table is not None:
    page_table, start = visible_pages(page_table, lengths[:, None] - 1, k_cache.shape[-2], spec.sliding_window)
    lengths = jnp.where(lengths > 0, lengths - start, 0)
  kernel = None if page_table is None else _paged_decode_kernel(spec.implementation, platform, q.dtype,
                                                                 k_cache.dtype)
  if kernel is not None:
    spec = spec.replace(interpret=interpret(platform))
    return _sharded_decode(functools.partial(kernel, spec=spec), q, k_cache, v_cache, lengths, page_table,
                           sinks, layer)
  if layer is not None:
    take = lambda x: None if x is None else jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)  # noqa: E731
    k_cache, v_cache = take(k_cache), take(v_cache)
  if page_table is not None and spec.implementation == "auto":
    return paged_decode_attention_xla(q, k_cache, v_cache, lengths, page_table, spec, sinks=sinks)
  return decode_attention_reference(q, k_cache, v_cache, lengths, spec, page_table=page_table, sinks=sinks)


def _paged_decode_kernel(implementation, platform, q_dtype, cache_dtype):
  """The kernel that reads a paged cache in place, or None for XLA's forms: Pallas on
  TPU/GPU (and "flash" elsewhere, interpreted), the C++ kernel for "auto" on CPU."""
  if implementation == "flash" or (implementation == "auto" and platform in ("tpu", "gpu")):
    return paged_decode_attention_gpu if platform == "gpu" else paged_decode_attention_tpu
  if implementation == "auto" and decode_cpu.available(q_dtype, cache_dtype):
    return decode_cpu.paged_decode_attention_cpu
  return None


def _sharded_decode(kernel, q, k_pages, v_pages, lengths, page_table, sinks, layer, int8=None):
  """`kernel` per device over the current mesh: rows over the batch axes, query and kv heads
  over the same axes; pages (stacked over layers when `layer` is given: each device reads
  its layer in place) shared by the rows, and so are int8 pages' scales and tails."""
  token = ("batch", _HEADS, "head_dim")
  # One kv head (MQA, a latent cache) is never split: every device's query heads read it.
  pages = _PAGES if k_pages.shape[-4] > 1 else (None,) + _PAGES[1:]
  if layer is not None:
    pages = (None, *pages)
    layer = jnp.asarray(layer, jnp.int32)
  if int8 is None:
    per_device = lambda q, k, v, n, t, i, sinks: kernel(q, k, v, n, t, layer=i, sinks=sinks)  # noqa: E731
    return logical_shard_map(per_device, (token, pages, pages, ("batch",), ("batch", None), (), (_HEADS,)),
                             token)(q, k_pages, v_pages, lengths, page_table, layer, sinks)
  scales = (*pages[:-1], None)
  per_device = lambda q, k, v, n, t, i, sinks, *extra: kernel(q, k, v, n, t, layer=i, sinks=sinks,  # noqa: E731
                                                              int8=Int8Pages(*extra))
  return logical_shard_map(per_device, (token, pages, pages, ("batch",), ("batch", None), (), (_HEADS,),
                                        scales, scales, pages, pages, ("batch",)),
                           token)(q, k_pages, v_pages, lengths, page_table, layer, sinks, *int8)


def reads_int8_pages(spec: AttentionSpec) -> bool:
  """Whether `int8_paged_decode` has a kernel here: the TPU kernel ("auto" on TPU; "flash"
  anywhere else, interpreted). Elsewhere the caller dequantizes the pages it reads."""
  platform = current_platform()
  return spec.implementation == "flash" and platform != "gpu" or spec.implementation == "auto" and platform == "tpu"


def int8_paged_decode(q, k_codes, v_codes, int8: Int8Pages, lengths, page_table, spec: AttentionSpec, *, layer,
                      sinks=None):
  """One new token per sequence against an int8 paged cache read as stored (decode_tpu.Int8Pages:
  codes [layers, Hkv, num_pages, page_size, D], per-token scales, each row's float tail),
  dequantized in the kernel's VMEM -> [B, Hq, Dv]. Where `reads_int8_pages(spec)`."""
  validation.check_sinks(sinks, q.shape[1])
  page_table, start = visible_pages(page_table, lengths[:, None] - 1, k_codes.shape[-2], spec.sliding_window)
  lengths = jnp.where(lengths > 0, lengths - start, 0)
  spec = spec.replace(interpret=interpret(current_platform()))
  return _sharded_decode(functools.partial(paged_decode_attention_tpu, spec=spec), q, k_codes, v_codes, lengths,
                         page_table, sinks, layer, int8)


def paged_attention(q, k_pages, v_pages, q_positions, page_table, spec: AttentionSpec = AttentionSpec(), *,
                    layer=None, sinks=None):
  """New tokens against a paged KV cache that already holds their keys -> [B, T, Hq, Dv].

  q: [B, T, Hq, D] at q_positions int [B, T] (negative: padding, output 0); each query
  sees the cached keys at positions 0..its own. Pages: k [Hkv, num_pages, page_size, D],
  v [.., Dv], or None with spec.value_dim (the keys' first entries: a latent cache), or with
  `layer` (an int scalar) both stacked over layers [layers, Hkv, ...] and that layer's read;
  page_table: int [B, pages_per_seq]. One token per sequence (decode) goes to
  `decode_attention` and its kernels; several (prefill) to the reference over the pages
  (only those inside a sliding window: positions contiguous per row).
  """
  if q.shape[1] == 1:
    lengths = jnp.maximum(q_positions[:, 0] + 1, 0)
    return decode_attention(q[:, 0], k_pages, v_pages, lengths, spec, page_table=page_table, layer=layer,
                            sinks=sinks)[:, None]
  if layer is not None:
    k_pages, v_pages = (None if x is None else jax.lax.dynamic_index_in_dim(x, layer, keepdims=False)
                        for x in (k_pages, v_pages))
  page_table, start = visible_pages(page_table, q_positions, k_pages.shape[2], spec.sliding_window)
  q_positions = jnp.where(q_positions >= 0, q_positions - start[:, None], -1)
  return paged_attention_reference(q, k_pages, v_pages, q_positions, page_table, spec, sinks=sinks)
