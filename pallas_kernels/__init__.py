"""Pallas kernels by family, each behind one door next to its pure-jnp reference.

Models call these entry points only; they pick the kernel for the backend and shape and
run it per device through the logical `shard_map` helper of `jaxpar.mesh`:

- attention: every door takes an `AttentionSpec` (the mask object, soft cap, scale, latent
  values, implementation, tiles); `attention(...)` (training / prefill; context-parallel when the mesh splits
  the sequence), `decode_attention(...)` (one new token against a KV cache),
  `paged_attention(...)` (new tokens against a paged cache; `visible_pages` narrows a page
  table to a sliding window); `zigzag` / `unzigzag` put a sequence in (out of) the
  load-balanced order context parallelism prefers.
- linear_attention: `gated_delta_rule(...)` (Gated DeltaNet's delta rule, Qwen3-Next's linear
  attention; packed sequences reset the state) and `gated_delta_step(...)` (one decode token).
- matmul: `quantized_matmul(x, weight)` with an int8 / int4 / W8A8 `QuantizedWeight`
  (`quantize_weight` makes one).
"""

from jaxpar.pallas_kernels.attention.block_sizes import BlockSizes, default_block_sizes
from jaxpar.pallas_kernels.attention.decode_tpu import Int8Pages
from jaxpar.pallas_kernels.attention.dispatch import (attention, choose_implementation, decode_attention,
                                                      int8_paged_decode, paged_attention, reads_int8_pages)
from jaxpar.pallas_kernels.attention.decode_common import visible_pages
from jaxpar.pallas_kernels.attention.layout import unzigzag, zigzag
from jaxpar.pallas_kernels.attention.reference import (attention_reference, decode_attention_reference,
                                                       paged_attention_reference)
from jaxpar.pallas_kernels.attention.spec import (IMPLEMENTATIONS, AttentionSpec, CausalMask, FullMask, LocalMask,
                                                 TreeMask)

from jaxpar.pallas_kernels.linear_attention import (gated_delta_rule, gated_delta_rule_reference,
                                                    gated_delta_step)

from jaxpar.pallas_kernels.matmul.block_sizes import MatmulBlocks
from jaxpar.pallas_kernels.matmul.dispatch import quantized_matmul
from jaxpar.pallas_kernels.matmul.format import QuantizedWeight
from jaxpar.pallas_kernels.matmul.quantize import dequantize_weight, quantize_weight

__all__ = ["MatmulBlocks", "QuantizedWeight", "dequantize_weight", "quantize_weight", "quantized_matmul",
           "IMPLEMENTATIONS", "AttentionSpec", "BlockSizes", "CausalMask", "FullMask", "LocalMask", "TreeMask", "attention",
           "attention_reference",
           "choose_implementation", "decode_attention", "decode_attention_reference", "Int8Pages",
           "int8_paged_decode", "reads_int8_pages",
           "default_block_sizes", "paged_attention", "paged_attention_reference", "unzigzag",
           "visible_pages", "zigzag", "gated_delta_rule", "gated_delta_rule_reference", "gated_delta_step"]
