"""Model FLOPs (MaxText's way of counting) and the CPU matmul rate to compare them with."""

import time

import jax
import jax.numpy as jnp


def matmul_params(model_cfg) -> int:
  """Parameters that take part in matmuls: every projection plus the output head."""
  m = model_cfg
  attn = m.embed_dim * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
  mlp = 3 * m.embed_dim * m.mlp_dim
  return m.num_layers * (attn + mlp) + m.embed_dim * m.vocab_size


def train_flops_per_token(model_cfg, seq_len: int) -> float:
  """6 x matmul params (forward + backward) plus causal attention scores and values:
  per layer 2 matmuls x 2 flops x seq x heads x head_dim, halved for the causal mask, x 3."""
  m = model_cfg
  attention = 6 * m.num_layers * seq_len * m.num_heads * m.head_dim
  return 6 * matmul_params(m) + attention


def measure_matmul_flops(dtype=jnp.float32, size: int = 2048, repeats: int = 5, device=None) -> float:
  """Best-of-`repeats` FLOP/s of one large square matmul on `device` (all host cores on CPU)."""
  device = device or jax.local_devices()[0]
  a = jax.device_put(jnp.ones((size, size), dtype), device)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size ** 3 / best
