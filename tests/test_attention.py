"""Flash kernels (TPU Mosaic and GPU Triton, in interpret mode) and the chunked XLA
path against the pure-jnp reference, forward and backward (dq, dk, dv).

Tolerances are relative to the largest reference value of each output. f32: the
kernels sum the same terms in another order (per key tile, online rescaling), a few
hundred ulps at most -> 1e-4. bf16: probabilities and dS are rounded to bf16 (8-bit
mantissa, eps 2^-8 = 0.4%) before each matmul, as FlashAttention does -> 2e-2, against
a float32 reference on the same bf16 inputs.
"""


import jax
import jax.numpy as jnp
import pytest

from jaxpar.pallas_kernels import AttentionSpec, BlockSizes, attention_reference
from jaxpar.pallas_kernels.attention.chunked import chunked_attention
from jaxpar.pallas_kernels.attention.flash_gpu import flash_attention_gpu
from jaxpar.pallas_kernels.attention.flash_tpu import flash_attention_tpu

TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def make_inputs(batch=1, q_len=384, kv_len=None, num_heads=2, num_kv_heads=2, head_dim=64,
                dtype=jnp.float32, segments=False, seed=0):
  kv_len = kv_len or q_len
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (batch, q_len, num_heads, head_dim), dtype)
  k = jax.random.normal(ks[1], (batch, kv_len, num_kv_heads, head_dim), dtype)
  v = jax.random.normal(ks[2], (batch, kv_len, num_kv_heads, head_dim), dtype)
  do = jax.random.normal(ks[3], q.shape, dtype)
  seg = None
  if segments:  # boundaries at arbitrary positions, so they fall inside tiles
    seg = jnp.cumsum(jax.random.bernoulli(ks[4], 0.02, (batch, kv_len)), axis=1).astype(jnp.int32)
  return q, k, v, do, seg


def assert_matches_reference(kernel, q, k, v, do, seg, tiles=None, **options):
  """The kernel's output and (dq, dk, dv) match the float32 reference on the same inputs.
  options: AttentionSpec.of's (causal, sliding_window, logit_soft_cap, scale...); the kernel
  runs them on `tiles` in interpret mode."""
  spec = AttentionSpec.of(**options)
  run = spec.replace(block_sizes=tiles, interpret=True)
  out, vjp = jax.vjp(jax.jit(lambda q, k, v: kernel(q, k, v, run, segment_ids=seg)), q, k, v)
  got = (out, *vjp(do))
  up = lambda x: x.astype(jnp.float32)
  ref_fn = lambda q, k, v: attention_reference(q, k, v, spec, segment_ids=seg)
  ref_out, ref_vjp = jax.vjp(ref_fn, up(q), up(k), up(v))
  want = (ref_out, *ref_vjp(up(do)))
  tol = TOLERANCE[q.dtype.type]
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
    assert a.dtype == q.dtype, name
    err = float(jnp.max(jnp.abs(up(a) - b)) / jnp.max(jnp.abs(b)))
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


# (name, inputs, options). Tiles of 128 make every length below span several tiles.
CASES = [
    ("causal_mha_f32", dict(), dict(causal=True)),
    ("full_gqa4_f32", dict(num_heads=4, num_kv_heads=1, q_len=256), dict(causal=False)),
    ("causal_gqa8_bf16_1024", dict(num_heads=8, num_kv_heads=1, q_len=1024, head_dim=128,
                                   dtype=jnp.bfloat16), dict(causal=True)),
    ("segments_window_softcap", dict(num_heads=4, num_kv_heads=2, segments=True),
     dict(causal=True, sliding_window=100, logit_soft_cap=20.0)),
    ("ragged_200_gqa4", dict(num_heads=4, num_kv_heads=1, q_len=200), dict(causal=True)),
    ("q_shorter_than_kv", dict(q_len=72, kv_len=300, num_heads=4, num_kv_heads=2),
     dict(causal=True)),
    ("full_segments_bf16", dict(batch=2, q_len=320, segments=True, dtype=jnp.bfloat16),
     dict(causal=False)),
    ("head_dim_256_bf16", dict(q_len=256, head_dim=256, dtype=jnp.bfloat16), dict(causal=True)),
    # Gemma 4's global heads (the TPU kernel only: validation.flash_head_dims).
    ("head_dim_512_gqa2_bf16", dict(q_len=256, head_dim=512, num_heads=4, num_kv_heads=2, dtype=jnp.bfloat16),
     dict(causal=True)),
]
TILES = BlockSizes(128, 128)


@pytest.mark.parametrize("name,inputs,options", CASES, ids=[c[0] for c in CASES])
def test_tpu_kernel_interpret(name, inputs, options):
  assert_matches_reference(flash_attention_tpu, *make_inputs(**inputs), tiles=TILES, **options)


@pytest.mark.slow
def test_tpu_kernel_interpret_2048_everything():
  inputs = make_inputs(q_len=2048, num_heads=4, num_kv_heads=1, head_dim=128,
                       dtype=jnp.bfloat16, segments=True)
  assert_matches_reference(flash_attention_tpu, *inputs, tiles=BlockSizes(256, 512, 256, 256), causal=True,
                           sliding_window=700, logit_soft_cap=30.0)


GPU_CASES = [CASES[i] for i in (2, 3, 4, 6)]


@pytest.mark.parametrize("name,inputs,options", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_kernel_interpret(name, inputs, options):
  assert_matches_reference(flash_attention_gpu, *make_inputs(**inputs), tiles=BlockSizes(64, 64, 32, 64),
                           **options)


@pytest.mark.parametrize("name,inputs,options", CASES, ids=[c[0] for c in CASES])
def test_chunked(name, inputs, options):
  assert_matches_reference(chunked_attention, *make_inputs(**inputs), tiles=TILES, **options)


def test_chunked_any_head_dim():
  assert_matches_reference(chunked_attention, *make_inputs(q_len=300, head_dim=16), tiles=TILES, causal=True)


def test_chunked_32k_trains_without_quadratic_buffer():
  """Compiled memory of the gradient at 32k tokens: far below one [L, L] f32 buffer."""
  length, shape = 32768, (1, 32768, 2, 64)
  spec = jax.ShapeDtypeStruct(shape, jnp.float32)
  loss = lambda q, k, v: jnp.sum(chunked_attention(q, k, v, AttentionSpec.of(causal=True)))
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < length * length * 4 / 16, f"{temp / 2**20:.0f} MiB of temporaries"
