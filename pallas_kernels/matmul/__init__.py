"""Quantized matmul kernels (W8A16, W4A16, W8A8) next to their pure-jnp reference, behind one
door (`dispatch.quantized_matmul`), with the quantizers that produce their weight format."""
