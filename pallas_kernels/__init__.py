"""Attention kernels behind one door each.

Models call `attention(...)` (training/prefill) and `decode_attention(...)` (one new
token against a KV cache) only; they pick the kernel for the backend and shape.
"""

from jaxpar.pallas_kernels.block_sizes import BlockSizes, default_block_sizes
from jaxpar.pallas_kernels.dispatch import (IMPLEMENTATIONS, attention, choose_implementation,
                                            decode_attention)
from jaxpar.pallas_kernels.reference import attention_reference, decode_attention_reference

__all__ = ["IMPLEMENTATIONS", "BlockSizes", "attention", "attention_reference",
           "choose_implementation", "decode_attention", "decode_attention_reference",
           "default_block_sizes"]
