"""Launch-parameter sweeps of the Triton kernels on a GPU, beside cuDNN / XLA on the same
shapes: what the GPU defaults were chosen from (docs/benchmarks.md#gpu).

    python benchmarks/gpu_sweep.py [--part flash decode matmul]

flash: B4 L4096 Hq32 Hkv8 D128 causal bf16, forward and forward+backward, per (block_q,
block_k, num_warps, num_stages), beside jax.nn.dot_product_attention(implementation="cudnn").
decode: the paged decode kernel per number of programs sharing a sequence (splits), at
`jaxpar check`'s shapes. matmul: int8 / int4 (group 128) / W8A8 at M 16 and 128, K = N = 8192,
per split-K, beside the bf16 dot. Times: median of 10 samples of back-to-back calls
(jaxpar.check.hardware.median_seconds).
"""

import argparse
import itertools

import jax
import jax.numpy as jnp

from jaxpar import pallas_kernels as pk
from jaxpar.check import kernels as check_kernels
from jaxpar.check.hardware import median_seconds
from jaxpar.pallas_kernels.attention import decode_gpu, flash_gpu
from jaxpar.pallas_kernels.matmul import gpu as matmul_gpu
from jaxpar.pallas_kernels.matmul.quantize import quantize_rows


def _time(fn, *args):
  """Milliseconds, or the error's name when Triton cannot build that variant."""
  try:
    return median_seconds(jax.jit(fn), *args) * 1e3
  except Exception as e:
    return type(e).__name__


def _row(name, ms, work=None, unit=""):
  rate = "" if isinstance(ms, str) or work is None else f" {work / ms / 1e9:9.1f} {unit}"
  print(f"{name:<44} {ms if isinstance(ms, str) else f'{ms:8.3f} ms'}{rate}", flush=True)


def flash():
  b, length, hq, hkv, d = 4, 4096, 32, 8, 128
  q = jax.random.normal(jax.random.key(0), (b, length, hq, d), jnp.bfloat16)
  k, v = (jax.random.normal(jax.random.key(i), (b, length, hkv, d), jnp.bfloat16) for i in (1, 2))
  fwd = 4 * b * hq * length * length * d / 2

  def grad_of(attend):
    return jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))

  cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
  _row("cudnn fwd", _time(cudnn, q, k, v), fwd, "TFLOP/s")
  _row("cudnn fwd+bwd", _time(grad_of(cudnn), q, k, v), 3.5 * fwd, "TFLOP/s")
  for bq, bk, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)):
    flash_gpu._FORWARD_PARAMS.update(num_warps=warps, num_stages=stages)
    blocks = pk.BlockSizes(bq, bk, 64, 64)
    _row(f"flash fwd q{bq} k{bk} w{warps} s{stages}",
         _time(lambda q, k, v: pk.attention(q, k, v, pk.AttentionSpec(implementation="flash", block_sizes=blocks)),
               q, k, v),
         fwd, "TFLOP/s")
  flash_gpu._FORWARD_PARAMS.update(num_warps=4, num_stages=3)
  for (bq, bk), warps in itertools.product(((32, 32), (64, 64), (64, 128), (128, 64)), (4, 8)):
    flash_gpu._BACKWARD_PARAMS.update(num_warps=warps)
    blocks = pk.BlockSizes(64, 64, bq, bk)
    spec = pk.AttentionSpec(implementation="flash", block_sizes=blocks)
    attend = lambda q, k, v, spec=spec: pk.attention(q, k, v, spec)  # noqa: E731
    _row(f"flash fwd+bwd, bwd q{bq} k{bk} w{warps}", _time(grad_of(attend), q, k, v), 3.5 * fwd, "TFLOP/s")
  flash_gpu._BACKWARD_PARAMS.update(num_warps=4)


def decode():
  setting = check_kernels.Setting(platform="gpu", mode="default", peaks={})
  for b, hq, hkv, d, max_len, page in ((32, 32, 8, 128, 4096, 16), (8, 32, 8, 128, 8192, 64), (1, 32, 8, 128, 8192, 16)):
    args, read = check_kernels._paged_inputs(setting, b, hq, hkv, d, max_len, page)
    default = decode_gpu.default_splits(b * hkv, args[4].shape[1])
    for splits in (1, 2, 4, 8, 16, 32, 64):
      run = lambda q, k, v, n, t, s=splits: decode_gpu.paged_decode_attention_gpu(q, k, v, n, t, splits=s)  # noqa: E731
      mark = " (default)" if splits == default else ""
      _row(f"decode B{b} len<={max_len} page{page} splits {splits}{mark}", _time(run, *args), read, "TB/s")


def matmul():
  k = n = 8192
  w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * k ** -0.5
  weights = {mode: pk.quantize_weight(w, mode, 128 if mode == "int4" else None) for mode in ("int8", "int4", "w8a8")}
  for m in (16, 128):
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
    dense = w.astype(jnp.bfloat16)
    _row(f"bf16 dot M{m}", _time(lambda x, w: x @ w, x, dense), dense.nbytes, "TB/s")
    xq, xs = quantize_rows(x)
    for mode, qw in weights.items():
      args = (xq, qw, xs) if mode == "w8a8" else (x, qw)
      for splits in (1, 2, 4, 8, 16):
        run = lambda *a, s=splits: matmul_gpu.quantized_matmul_gpu(*a, splits=s)  # noqa: E731
        _row(f"{mode} M{m} splits {splits}", _time(run, *args), qw.nbytes, "TB/s")


PARTS = {"flash": flash, "decode": decode, "matmul": matmul}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--part", nargs="+", choices=PARTS, default=list(PARTS))
  args = parser.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__)
  for part in args.part:
    PARTS[part]()


if __name__ == "__main__":
  main()
