"""How far batch decode on this CPU can go: jaxpar's step against the least work a step must do.

    python benchmarks/decode_floor.py [--batch 32] [--repeats 5] [--burst 4]

`benchmarks/decode.py` compares whole generations with `transformers`. This script asks what
a batch-`--batch` decode step of the bench-20m shape (4 layers, embed 256, 4 heads x 64,
MLP 1024, vocab 32000, float32, random weights) could cost at best here, and prints, in one
run and in milliseconds per generated token step:

- transformers: `generate`, timed as decode.py times it (64 new tokens after a 64-token prompt);
- jaxpar engine: the same requests through `Engine`, 1 step per call and `--burst` per call;
  then 1 step per call without running ahead (`Engine(run_ahead=False)`: each step's tokens
  read before the next is dispatched) and with XLA's decode attention instead of the C++
  kernel (`JAXPAR_CPU_KERNELS=0`);
- dense step (XLA): the same matmuls, RMS norms and attention in XLA over keys and values
  already contiguous [batch, heads, 96, 64] (the mean cached length of those 64 tokens), a
  greedy argmax (the engine's; it computes log-probabilities only for requests that ask).
  No rotary embedding, no cache write, no page table, no sampling settings, no host; its
  attention is XLA's batched dots, which the engine's C++ kernel beats, so the engine can
  come in under it;
- matmul floor: only the step's matrix multiplies (each layer's q/k/v, o, gate, up and down,
  and the output projection), in XLA, and the same shapes in torch (what transformers runs).

Each time is the best of `--repeats` (a busy host only adds time); transformers and the
engine are timed in alternating rounds (`decode.side_by_side`), the XLA steps after them.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode  # noqa: E402

from jaxpar.config import load_config  # noqa: E402
from jaxpar.inference.sampling import argmax  # noqa: E402

PROMPT, NEW = 64, 64
MEAN_LENGTH = PROMPT + NEW // 2  # the cached length, averaged over the generated tokens


def per_call(fn, repeats, calls=20):
  """Seconds per call of fn, each waited for (as the engine waits for each step's tokens):
  the best over `repeats` of `calls` calls in a row."""
  return decode.best(lambda: [jax.block_until_ready(fn()) for _ in range(calls)], repeats) / calls


def random_weights(cfg, rng):
  embed, heads, dim, mlp = cfg.embed_dim, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
  def w(*shape):
    return rng.standard_normal(shape, np.float32) * 0.05
  layers = [{"qkv": w(embed, 3 * heads * dim), "o": w(heads * dim, embed), "gate": w(embed, mlp),
             "up": w(embed, mlp), "down": w(mlp, embed)} for _ in range(cfg.num_layers)]
  return layers, w(embed, cfg.vocab_size)


def xla_floors(cfg, batch, repeats):
  """(dense step, matmul floor) seconds per step."""
  rng = np.random.default_rng(0)
  layers, head = jax.tree.map(jnp.asarray, random_weights(cfg, rng))
  heads, dim = cfg.num_heads, cfg.head_dim
  x = jnp.asarray(rng.standard_normal((batch, cfg.embed_dim), np.float32))
  keys, values = ([jnp.asarray(rng.standard_normal((batch, heads, MEAN_LENGTH, dim), np.float32))
                   for _ in range(cfg.num_layers)] for _ in range(2))  # one array a layer: nothing sliced

  def rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps)

  def matmuls(layers, head, x):
    for p in layers:
      q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)  # all three used: XLA keeps the whole product
      x = x + (q + k + v) @ p["o"]
      x = x + (jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]
    return x @ head

  def dense(layers, head, x, keys, values):
    for i, p in enumerate(layers):
      q, k, v = (t.reshape(batch, heads, dim) for t in jnp.split(rms(x) @ p["qkv"], 3, axis=-1))
      # The cached keys, then the new token's own (kept apart: no copy of the cache).
      scores = jnp.concatenate([jnp.einsum("bhtd,bhd->bht", keys[i], q), jnp.sum(k * q, -1)[..., None]], -1)
      probs = jax.nn.softmax(scores * dim ** -0.5, axis=-1)
      attended = jnp.einsum("bht,bhtd->bhd", probs[..., :-1], values[i]) + probs[..., -1:] * v
      x = x + attended.reshape(batch, heads * dim) @ p["o"]
      h = rms(x)
      x = x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
    return argmax(rms(x) @ head)

  dense_step, matmul_step = jax.jit(dense), jax.jit(matmuls)
  return (per_call(lambda: dense_step(layers, head, x, keys, values), repeats),
          per_call(lambda: matmul_step(layers, head, x), repeats))


def torch_matmul_floor(cfg, batch, repeats):
  """Seconds per step of the same matrix multiplies in torch (transformers' own kernels)."""
  import torch
  layers, head = random_weights(cfg, np.random.default_rng(0))
  # torch's Linear keeps weights [out, in]; transformers calls F.linear on them.
  layers = [{k: torch.from_numpy(v.T.copy()) for k, v in p.items()} for p in layers]
  head = torch.from_numpy(head.T.copy())
  x0 = torch.randn(batch, cfg.embed_dim)
  linear, width = torch.nn.functional.linear, cfg.num_heads * cfg.head_dim

  def step():
    with torch.no_grad():
      x = x0
      for p in layers:
        q, k, v = linear(x, p["qkv"]).split(width, dim=-1)
        x = x + linear(q + k + v, p["o"])
        x = x + linear(torch.nn.functional.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])
      return linear(x, head)
  return per_call(step, repeats)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--burst", type=int, default=4)
  args = parser.parse_args()
  cfg, batch = load_config("bench-20m").model, args.batch
  prompts = np.random.default_rng(batch).integers(0, 256, (batch, PROMPT)).tolist()

  os.environ["JAXPAR_CPU_KERNELS"] = "0"  # read when the engine compiles its programs
  xla_attention = decode.jaxpar_generate(cfg, batch, prompts, NEW)
  os.environ["JAXPAR_CPU_KERNELS"] = "1"
  times = decode.side_by_side({"transformers generate": decode.hf_generate(cfg, prompts),
                               "jaxpar engine, 1 step per call": decode.jaxpar_generate(cfg, batch, prompts, NEW),
                               f"jaxpar engine, {args.burst} steps per call":
                               decode.jaxpar_generate(cfg, batch, prompts, NEW, args.burst),
                               "  without running ahead": decode.jaxpar_generate(cfg, batch, prompts, NEW,
                                                                                  run_ahead=False),
                               "  with XLA's decode attention": xla_attention}, NEW, args.repeats)
  rows = [(label, (full - first) / (NEW - 1)) for label, (first, full) in times.items()]
  dense, matmuls = xla_floors(cfg, batch, args.repeats)
  rows += [("dense step (XLA)", dense), ("matmul floor (XLA)", matmuls),
           ("matmul floor (torch)", torch_matmul_floor(cfg, batch, args.repeats))]
  hf = rows[0][1]
  print(f"bench-20m shape, batch {batch}, float32, {os.cpu_count()} cores; ms per token step; "
        f"transformers' step / this\n")
  print(f"| {'':<34} | {'ms':>6} | {'vs transformers':>15} |\n| {'-' * 34} | {'-' * 6} | {'-' * 15} |")
  for label, seconds in rows:
    print(f"| {label:<34} | {seconds * 1e3:>6.2f} | {hf / seconds:>14.2f}x |")


if __name__ == "__main__":
  main()
