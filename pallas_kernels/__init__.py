"""Attention and matmul kernels behind one door each.

Models call `attention(...)` only; it picks the kernel for the backend and shape.
"""

from jaxpar.pallas_kernels.dispatch import attention

__all__ = ["attention"]
