"""Linear-attention hybrids (Qwen3.5, Qwen3-Next, Kimi Linear) against softmax attention: three tables.

    python benchmarks/families.py --linear      (or python benchmarks/linear_attention.py)

1. Cache bytes of one 32,768-token sequence, counted by the cache code itself (bf16 pages
   of 16; the linear layers' per-slot state as the engine keeps it: the delta-rule state in
   float32, the convolution's last inputs in bf16), per token.
2. Token mixing on 1 CPU device (float32, batch 1, 4 value / query heads of 64 on 2 key /
   kv heads): the Gated DeltaNet door (chunked, chunks of 64) and the attention door (causal,
   the CPU's chunked form), forward and backward of a sum, tokens/s, median of 3 after a
   warm-up, at 2k to 32k tokens.
3. Collective bytes per layer under context parallelism (4 simulated CPU devices, a tiny
   model whose every layer is one kind, its train step compiled): Gated DeltaNet layers
   (LASP-2: convolution tails and piece states) against softmax attention layers (the
   configured context attention), summed over the collectives in the layer loop.
"""

import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar.config import MeshConfig, load_config  # noqa: E402
from jaxpar.models import caches  # noqa: E402
from jaxpar.models.transformer import layer_groups  # noqa: E402
from jaxpar.models.layer_pattern import sliding_windows  # noqa: E402

PAGE = 16


def cache_bytes_per_sequence(name: str, seq_len: int) -> dict:
  m = load_config(name).model
  cache = jax.eval_shape(lambda: {g.name: caches.init(m, g.count, seq_len // PAGE, PAGE, jnp.bfloat16, slots=1,
                                                      windows=sliding_windows(m, g.indices), mixer=g.mixer)
                                  for g in layer_groups(m)})
  held = caches.cache_bytes(cache)
  return {"model": name, "layers": m.num_layers, "attention": sum(g.count for g in layer_groups(m) if g.mixer != "gated_deltanet"),
          "pages": held["pool"], "states": held["states"]}


def print_cache_bytes(seq_len: int = 32768):
  rows = [cache_bytes_per_sequence(n, seq_len) for n in ("llama3-8b", "qwen3.5-9b", "qwen3-next-80b-a3b",
                                                          "kimi-linear-48b-a3b")]
  base = (rows[0]["pages"] + rows[0]["states"]) / seq_len
  print(f"Cache of one {seq_len:,}-token sequence (bf16 KV pages of {PAGE}; linear layers' delta-rule state f32, "
        "convolution inputs bf16)\n")
  header = f"{'model':<20} {'attention/all':>13} {'KV pages':>10} {'states':>10} {'per token':>10} {'x llama3-8b':>12}"
  print(header + "\n" + "-" * len(header))
  for r in rows:
    per_token = (r["pages"] + r["states"]) / seq_len
    print(f"{r['model']:<20} {r['attention']:>6}/{r['layers']:<6} {r['pages'] / 2**20:>6,.0f} MiB "
          f"{r['states'] / 2**20:>6,.1f} MiB {per_token:>10,.0f} {per_token / base:>12.2f}")


def _median_seconds(fn, *args, repeats: int = 3) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def mixing_tokens_per_second(length: int, heads: int = 4, key_heads: int = 2, dim: int = 64) -> tuple[float, float]:
  from jaxpar import pallas_kernels
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  q, k = unit(normal(1, length, key_heads, dim)), unit(normal(1, length, key_heads, dim))
  v, decay = normal(1, length, heads, dim), -jax.nn.softplus(normal(1, length, heads))
  beta = jax.nn.sigmoid(normal(1, length, heads))
  linear = jax.jit(jax.grad(lambda q, k, v: jnp.sum(pallas_kernels.gated_delta_rule(q, k, v, decay, beta)[0]),
                            argnums=(0, 1, 2)))
  spec = pallas_kernels.AttentionSpec.of(causal=True)
  softmax = jax.jit(jax.grad(lambda q, k, v: jnp.sum(pallas_kernels.attention(q, k, v, spec)), argnums=(0, 1, 2)))
  q_heads, v_kv = normal(1, length, heads, dim), normal(1, length, key_heads, dim)  # GQA: 4 query heads on 2
  return length / _median_seconds(linear, q, k, v), length / _median_seconds(softmax, q_heads, k, v_kv)


def print_mixing_throughput(lengths=(2048, 8192, 32768)):
  print("Token mixing on 1 CPU device, forward + backward (float32, batch 1, 4 heads of 64 on 2 key heads)\n")
  header = f"{'tokens':>7} {'Gated DeltaNet tok/s':>21} {'softmax tok/s':>14} {'ratio':>7}"
  print(header + "\n" + "-" * len(header))
  for length in lengths:
    linear, softmax = mixing_tokens_per_second(length)
    print(f"{length:>7,} {linear:>21,.0f} {softmax:>14,.0f} {linear / softmax:>7.2f}", flush=True)


def layer_loop_collective_bytes(mixer: str, seq_len: int) -> float:
  """Bytes per device of the collectives in the layer loop, per layer, of a tiny one-kind model's
  train step with its sequence split 4 ways over `context`."""
  from jaxpar.aot import hlo
  from jaxpar.objectives.lm import lm_loss
  from jaxpar.runtime import Runtime
  from jaxpar.train.step import make_gradients
  model = load_config("tiny-qwen3.5", [f"model.max_seq_len={seq_len}", "model.num_layers=2"]).model
  model = type(model)(**{**model.model_dump(), "layer_pattern": [{"mixer": mixer}]})
  runtime = Runtime(model, MeshConfig(context=4, fsdp=1), jax.devices()[:4])
  tokens = np.random.default_rng(0).integers(0, 256, (2, seq_len), dtype=np.int32)
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (2, seq_len))
  batch = {"inputs": tokens, "targets": tokens, "positions": positions, "loss_mask": np.ones((2, seq_len), np.float32),
           "segment_ids": np.ones((2, seq_len), np.int32)}
  step = jax.jit(make_gradients(lm_loss(runtime.graphdef, z_loss=0.0, logits_chunk_len=0), microbatches=1))
  params, _ = runtime.init()
  with runtime.context():
    found = hlo.collectives(step.lower(params, batch).compile().as_text(), cpu=True)
  return sum(c.bytes for c in found if c.count == model.num_layers) / model.num_layers


def print_context_collectives(lengths=(1024, 2048, 4096)):
  print("Collective bytes per layer and device in the compiled train step, sequence over 4 context devices\n")
  header = f"{'tokens':>7} {'Gated DeltaNet (LASP-2)':>24} {'softmax attention':>18}"
  print(header + "\n" + "-" * len(header))
  for length in lengths:
    linear, softmax = (layer_loop_collective_bytes(m, length) for m in ("gated_deltanet", "gqa"))
    print(f"{length:>7,} {linear / 2**10:>20,.0f} KiB {softmax / 2**10:>14,.0f} KiB", flush=True)


def main():
  print_cache_bytes()
  print()
  print_context_collectives()
  print()
  print_mixing_throughput()


if __name__ == "__main__":
  main()
