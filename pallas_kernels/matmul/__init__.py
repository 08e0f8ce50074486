"""Matmul kernels (quantized weights): each next to its pure-jnp reference, behind one door."""
