"""Context parallelism at the attention door, on 8 simulated devices (data 2 x context 4):
ring and all-gather attention equal the reference, forward and backward, for causal and
full masks, GQA, packed segments and sliding windows, in zig-zag and contiguous order, at
lengths that fill no kernel tile; the blockwise kernels (chunked, and the TPU and GPU flash
kernels in interpret mode) take any query offset, including blocks the mask hides
entirely; zig-zag order balances causal work; what cannot be split is a one-line error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import pallas_kernels
from jaxpar.pallas_kernels.attention import chunked, flash_gpu, flash_tpu
from jaxpar.pallas_kernels import AttentionSpec
from jaxpar.pallas_kernels.attention.blockwise import merge_partials
from jaxpar.pallas_kernels.attention.layout import SequenceSplit

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")
CONTEXT = 4


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((2, 1, 1, CONTEXT, 1, 1), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 6)


def _inputs(length=96, num_heads=4, num_kv_heads=2, head_dim=16, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (2, length, num_heads, head_dim))
  k = jax.random.normal(ks[1], (2, length, num_kv_heads, head_dim))
  v = jax.random.normal(ks[2], (2, length, num_kv_heads, head_dim))
  # Documents end at different places in each row, inside pieces and on their edges.
  cuts = np.array([[30, 48, 70], [12, 60, 61]])
  seg = jnp.asarray((np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)
  return q, k, v, seg


def _loss_and_grads(attend, q, k, v):
  return jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))), argnums=(0, 1, 2))(q, k, v)


def _assert_close(got, want, tol=1e-4):
  for name, a, b in zip(("loss", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    assert err < tol, f"{name}: relative error {err:.1e}"


CASES = [
    ("ring_zigzag_causal", "ring", True, dict()),
    ("ring_zigzag_segments_window", "ring", True, dict(segments=True, sliding_window=20)),
    ("ring_zigzag_full_segments", "ring", True, dict(causal=False, segments=True)),
    ("ring_contiguous_full", "ring", False, dict(causal=False)),
    ("all_gather_zigzag_segments", "all_gather", True, dict(segments=True)),
    ("all_gather_contiguous_window", "all_gather", False, dict(sliding_window=20)),
]


@pytest.mark.parametrize("name,strategy,zigzag,options", CASES, ids=[c[0] for c in CASES])
def test_context_parallel_attention_matches_reference(mesh, name, strategy, zigzag, options):
  q, k, v, seg = _inputs()  # 96 tokens: pieces of 12 (zig-zag) or 24, tiles of 8
  seg = seg if options.pop("segments", False) else None
  order = (lambda x: pallas_kernels.zigzag(x, CONTEXT)) if zigzag else (lambda x: x)
  back = (lambda x: pallas_kernels.unzigzag(x, CONTEXT)) if zigzag else (lambda x: x)

  spec = AttentionSpec.of(**options)
  tiled = spec.replace(implementation="chunked", block_sizes=pallas_kernels.BlockSizes(8, 8))

  def split(q, k, v):
    out = pallas_kernels.attention(order(q), order(k), order(v), tiled,
                                   segment_ids=None if seg is None else order(seg),
                                   context_parallel=strategy, zigzag=zigzag)
    return back(out)

  with jax.set_mesh(mesh):
    got = jax.jit(lambda q, k, v: _loss_and_grads(split, q, k, v))(q, k, v)
  want = _loss_and_grads(lambda q, k, v: pallas_kernels.attention_reference(
      q, k, v, spec, segment_ids=seg), q, k, v)
  _assert_close(got, want)


def test_zigzag_order_and_its_sharded_form(mesh):
  tokens = jnp.broadcast_to(jnp.arange(96), (2, 96))
  order = pallas_kernels.zigzag(tokens, CONTEXT)
  chunks = np.asarray(order[0]).reshape(CONTEXT, 2, 12)[:, :, 0] // 12
  assert chunks.tolist() == [[0, 7], [1, 6], [2, 5], [3, 4]]  # device d: chunks d, 2N-1-d
  np.testing.assert_array_equal(pallas_kernels.unzigzag(order, CONTEXT), tokens)
  with jax.set_mesh(mesh):  # split over `length`: reordered in place with ppermutes
    sharded = jax.jit(lambda x: pallas_kernels.zigzag(x, CONTEXT))(tokens)
    assert "collective-permute" in jax.jit(lambda x: pallas_kernels.zigzag(x, CONTEXT)).lower(
        tokens).compile().as_text()
  np.testing.assert_array_equal(sharded, order)


BLOCKWISE = [
    ("chunked", chunked.BLOCKWISE, pallas_kernels.BlockSizes(64, 64), 16),
    ("flash_tpu_interpret", flash_tpu.BLOCKWISE, pallas_kernels.BlockSizes(128, 128), 64),
    ("flash_gpu_interpret", flash_gpu.BLOCKWISE, pallas_kernels.BlockSizes(32, 32), 64),
]


@pytest.mark.parametrize("name,kernel,blocks,head_dim", BLOCKWISE, ids=[b[0] for b in BLOCKWISE])
def test_blockwise_kernels_take_any_query_offset(name, kernel, blocks, head_dim):
  """Query and key halves paired with their relative offset (negative: the queries come
  before the keys, so the causal mask hides the whole block), merged through their
  log-sum-exps, equal whole attention; so do the summed per-block gradients."""
  q, k, v, seg = _inputs(length=256, head_dim=head_dim)
  do = jax.random.normal(jax.random.key(1), q.shape)
  window = AttentionSpec.of(sliding_window=150)
  spec = window.replace(block_sizes=blocks, interpret=True)
  halves = [(0, 128), (128, 128)]
  cut = lambda x, lo, n: x[:, lo:lo + n]

  @jax.jit
  def pieces(q, k, v, do):
    outs = []
    for a, n in halves:
      partial = None
      for b, m in halves:
        block = kernel.forward(spec, cut(q, a, n), cut(k, b, m), cut(v, b, m), None,  # no sinks
                               cut(seg, a, n), cut(seg, b, m), jnp.int32(a - b))
        partial = block if partial is None else merge_partials(partial, block)
      outs.append(partial)
    dq, dk, dv = jnp.zeros(q.shape), jnp.zeros(k.shape), jnp.zeros(v.shape)
    for (a, n), (o, lse) in zip(halves, outs):
      for b, m in halves:
        dq_i, dk_j, dv_j = kernel.backward(spec, cut(q, a, n), cut(k, b, m), cut(v, b, m),
                                           cut(seg, a, n), cut(seg, b, m), jnp.int32(a - b),
                                           o.astype(q.dtype), lse, cut(do, a, n))
        dq, dk, dv = dq.at[:, a:a + n].add(dq_i), dk.at[:, b:b + m].add(dk_j), dv.at[:, b:b + m].add(dv_j)
    return jnp.concatenate([o for o, _ in outs], axis=1), dq, dk, dv

  out, ref_vjp = jax.vjp(lambda q, k, v: pallas_kernels.attention_reference(
      q, k, v, window, segment_ids=seg), q, k, v)
  _assert_close(pieces(q, k, v, do), (out, *ref_vjp(do)))


def test_zigzag_balances_causal_work_and_contiguous_does_not():
  """Per-device tiles the kernels compute under a causal mask (8 devices, 8k tokens)."""
  zigzag = SequenceSplit(("context",), 8, zigzag=True).causal_tiles(8192, 128)
  contiguous = SequenceSplit(("context",), 8, zigzag=False).causal_tiles(8192, 128)
  assert max(zigzag) <= 1.10 * min(zigzag), zigzag
  assert max(contiguous) >= 4 * min(contiguous), contiguous
  assert sum(zigzag) == sum(contiguous)  # the same work, only spread differently


def test_what_cannot_be_split_is_a_one_line_error(mesh):
  q, k, v, _ = _inputs(length=96)
  run = lambda q, k, v, implementation="chunked", **kw: pallas_kernels.attention(  # noqa: E731
      q, k, v, AttentionSpec(implementation=implementation), **kw)
  with jax.set_mesh(mesh):
    with pytest.raises(ValueError, match=r"sequence length 90 does not split evenly over the 4 "
                                         r"devices.*multiple of 8 \(zig-zag"):
      run(q[:, :90], k[:, :90], v[:, :90], zigzag=True)
    with pytest.raises(ValueError, match="'reference' materialises whole score matrices"):
      run(q, k, v, implementation="reference")
    with pytest.raises(ValueError, match="'flash' runs in interpret mode on cpu"):
      run(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match="self-attention only, got 48 queries and 96 keys"):
      run(q[:, :48], k, v)
    with pytest.raises(ValueError, match="context_parallel='rings' is not one of"):
      run(q, k, v, context_parallel="rings")


def test_config_errors_name_the_key():
  from jaxpar.config import ConfigError
  from tests.helpers import small_config
  with pytest.raises(ConfigError, match=r"data.seq_len=36 must be a multiple of 8 to split over "
                                        r"mesh.context=4 \(zig-zag load balancing"):
    small_config(mesh={"context": 4}, data={"seq_len": 36})
  small_config(mesh={"context": 4}, parallel={"context": {"load_balance": False}}, data={"seq_len": 36})
  with pytest.raises(ConfigError, match="model.attention='reference' with mesh.context=2"):
    small_config(mesh={"context": 2}, model={"attention": "reference"})
  with pytest.raises(ConfigError, match=r"data.seq_len=33 must be a multiple of mesh.context x "
                                        r"mesh.tensor = 2 for parallel.sequence_parallel"):
    small_config(mesh={"tensor": 2}, parallel={"sequence_parallel": True}, data={"seq_len": 33})
