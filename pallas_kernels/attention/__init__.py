"""Attention kernels: FlashAttention-2 (Mosaic TPU, Triton GPU), paged decode, a chunked
XLA path and the pure-jnp references they are tested against, behind `dispatch.py`."""
