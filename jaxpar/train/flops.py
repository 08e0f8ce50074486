"""Model FLOPs (MaxText's way of counting) and the CPU matmul rate to compare them with."""

import time

import jax
import jax.numpy as jnp

from jaxpar.models import get_family


def train_flops_per_token(model_cfg, seq_len: int) -> float:
  """Training FLOPs per token (6 x matmul params + causal attention), as the model's
  family counts them."""
  return get_family(model_cfg.family).flops_per_token(model_cfg, seq_len)


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
