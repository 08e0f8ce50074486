"""The gated delta rule (pallas_kernels/linear_attention): the chunked WY form and the Pallas
TPU and GPU kernels (interpret mode) equal the token-by-token reference (outputs, final state
and gradients) with grouped heads, Dk != Dv, an initial state, a length no multiple of the
chunk and packed sequences, with a decay per head (Gated DeltaNet) and, for the XLA form, per
key channel (Kimi Delta Attention); the reference's resets equal running each sequence alone;
the decode step, token by token, equals the reference; the kernels run split over a mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.pallas_kernels import gated_delta_rule, gated_delta_rule_reference, gated_delta_step
from jaxpar.pallas_kernels.linear_attention.chunked import gated_delta_rule_chunked
from jaxpar.pallas_kernels.linear_attention.kernel import gated_delta_rule_pallas

BATCH, LENGTH, KEY_HEADS, HEADS, KEY_DIM, VALUE_DIM, CHUNK = 2, 37, 2, 4, 8, 12, 16
# Three packed sequences a row: row 0's start inside a chunk (10) and at a chunk edge (32);
# row 1's last reuses its first one's id (a sequence starts where the id changes).
STARTS, IDS = ((0, 10, 32), (0, 5, 21)), ((0, 1, 2), (3, 7, 3))
TOL = dict(rtol=1e-5, atol=1e-5)

reference = jax.jit(gated_delta_rule_reference)
chunked = jax.jit(gated_delta_rule_chunked, static_argnames="chunk_size")


def packed_segment_ids():
  ids = np.empty((BATCH, LENGTH), np.int32)
  for row, (starts, names) in enumerate(zip(STARTS, IDS)):
    for start, end, name in zip(starts, starts[1:] + (LENGTH,), names):
      ids[row, start:end] = name
  return ids


def inputs(seed=0, key_heads=KEY_HEADS, length=LENGTH, per_channel=False, dims=(KEY_DIM, VALUE_DIM)):
  """(q, k, v, g, beta, initial_state) as the model block gives them: unit q and k, decays
  exp(g) in (0, 1) (one per head, or with `per_channel` one per key channel), beta in (0, 1)."""
  rng = np.random.default_rng(seed)
  key_dim, value_dim = dims
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  q, k = (unit(rng.normal(size=(BATCH, length, key_heads, key_dim))) for _ in range(2))
  v = rng.normal(size=(BATCH, length, HEADS, value_dim))
  g = -np.logaddexp(0.0, rng.normal(size=(BATCH, length, HEADS) + ((key_dim,) if per_channel else ()))) * 0.5
  beta = 1 / (1 + np.exp(-rng.normal(size=(BATCH, length, HEADS))))
  state = rng.normal(size=(BATCH, HEADS, key_dim, value_dim))
  return tuple(x.astype(np.float32) for x in (q, k, v, g, beta, state))


PER_CHANNEL = pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])


@PER_CHANNEL
@pytest.mark.parametrize("chunk_size", [CHUNK, 64], ids=["padded_chunks", "one_chunk"])
@pytest.mark.parametrize("segment_ids", [None, packed_segment_ids()], ids=["one_sequence", "packed"])
def test_chunked_equals_the_reference(segment_ids, chunk_size, per_channel):
  *tokens, state = inputs(per_channel=per_channel)
  want_out, want_state = reference(*tokens, initial_state=state, segment_ids=segment_ids)
  out, final = chunked(*tokens, initial_state=state, segment_ids=segment_ids, chunk_size=chunk_size)
  np.testing.assert_allclose(out, want_out, **TOL)
  np.testing.assert_allclose(final, want_state, **TOL)
  assert out.shape == (BATCH, LENGTH, HEADS, VALUE_DIM) and final.shape == state.shape


def test_a_packed_sequence_runs_as_if_alone():
  """The reset is shown, not assumed: each packed sequence's outputs are those of the sequence
  run alone (from the row's initial state for the first, from zeros after), and the final
  state is the last sequence's own."""
  *tokens, state = inputs(seed=1)
  out, final = reference(*tokens, initial_state=state, segment_ids=packed_segment_ids())
  for row, starts in enumerate(STARTS):
    for start, end in zip(starts, starts[1:] + (LENGTH,)):
      alone = [x[row:row + 1, start:end] for x in tokens]
      first = state[row:row + 1] if start == 0 else np.zeros_like(state[row:row + 1])
      want_out, want_state = reference(*alone, initial_state=first)
      np.testing.assert_allclose(out[row:row + 1, start:end], want_out, **TOL)
    np.testing.assert_allclose(final[row:row + 1], want_state, **TOL)


def _gradients(fn, segment_ids, per_channel=False, dims=(KEY_DIM, VALUE_DIM)):
  """Gradients of a scalar of both results w.r.t. q, k, v, g, beta and the initial state."""
  rng = np.random.default_rng(2)
  out_weights = rng.normal(size=(BATCH, LENGTH, HEADS, dims[1])).astype(np.float32)
  state_weights = rng.normal(size=(BATCH, HEADS, *dims)).astype(np.float32)

  def loss(*args):
    *tokens, state = args
    out, final = fn(*tokens, initial_state=state, segment_ids=segment_ids)
    return jnp.sum(out * out_weights) + jnp.sum(final * state_weights)

  return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*inputs(seed=3, per_channel=per_channel, dims=dims))


@PER_CHANNEL
@pytest.mark.parametrize("segment_ids", [None, packed_segment_ids()], ids=["one_sequence", "packed"])
def test_chunked_gradients_equal_the_reference(segment_ids, per_channel):
  want = _gradients(gated_delta_rule_reference, segment_ids, per_channel)
  got = _gradients(functools.partial(gated_delta_rule_chunked, chunk_size=CHUNK), segment_ids, per_channel)
  for name, grad, want_grad in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
    assert np.isfinite(grad).all(), name
    np.testing.assert_allclose(grad, want_grad, **TOL, err_msg=name)


# Triton's dots want power-of-two tiles of at least 16; the TPU kernel takes the odd dims.
KERNEL_DIMS = {"tpu": (KEY_DIM, VALUE_DIM), "gpu": (16, 32)}


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
@pytest.mark.parametrize("segment_ids", [None, packed_segment_ids()], ids=["one_sequence", "packed"])
def test_the_kernels_equal_the_reference(segment_ids, backend):
  """Three chunks of 16 over 37 tokens (the last padded), two value heads per key head, an
  initial state; outputs, final state and all six gradients."""
  dims = KERNEL_DIMS[backend]
  kernel = functools.partial(gated_delta_rule_pallas, chunk_size=CHUNK, backend=backend, interpret=True)
  *tokens, state = inputs(dims=dims)
  want = reference(*tokens, initial_state=state, segment_ids=segment_ids)
  got = jax.jit(kernel)(*tokens, initial_state=state, segment_ids=segment_ids)
  for name, a, b in zip(("out", "final state"), got, want):
    np.testing.assert_allclose(a, b, **TOL, err_msg=name)
  want = _gradients(gated_delta_rule_reference, segment_ids, dims=dims)
  for name, grad, want_grad in zip(("q", "k", "v", "g", "beta", "initial_state"),
                                   _gradients(kernel, segment_ids, dims=dims), want):
    np.testing.assert_allclose(grad, want_grad, **TOL, err_msg=name)


def test_the_kernel_door_splits_batch_and_heads_over_a_mesh():
  """implementation="pallas" on data=2 x tensor=2 devices (each runs its batch rows and head
  block in interpret mode) equals the reference, gradients included."""
  mesh = jax.make_mesh((2, 1, 1, 1, 1, 2), ("data", "stage", "fsdp", "context", "expert", "tensor"),
                       devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,) * 6)
  *tokens, state = inputs(seed=5)
  segments = packed_segment_ids()

  def loss(implementation):
    def f(*args):
      out, final = gated_delta_rule(*args[:5], initial_state=args[5], segment_ids=segments,
                                    implementation=implementation, chunk_size=CHUNK)
      return jnp.sum(jnp.sin(out)) + jnp.sum(final * final)
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(6))))

  with jax.set_mesh(mesh):
    got = loss("pallas")(*tokens, state)
    jaxpr = str(jax.make_jaxpr(loss("pallas"))(*tokens, state))
  want = loss("reference")(*tokens, state)
  assert "shard_map" in jaxpr
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, **TOL)


@PER_CHANNEL
def test_the_decode_step_token_by_token_equals_the_reference(per_channel):
  *tokens, state = inputs(seed=4, per_channel=per_channel)
  want_out, want_state = reference(*tokens, initial_state=state)
  step = jax.jit(gated_delta_step)
  outs = []
  for t in range(LENGTH):
    out, state = step(state, *(x[:, t] for x in tokens))
    outs.append(out)
  np.testing.assert_allclose(np.stack(outs, axis=1), want_out, **TOL)
  np.testing.assert_allclose(state, want_state, **TOL)


def test_the_door_runs_the_chunked_form_and_refuses_bad_arguments():
  *tokens, state = inputs()
  door = jax.jit(functools.partial(gated_delta_rule, chunk_size=CHUNK))
  for got, want in zip(door(*tokens, initial_state=state), chunked(*tokens, initial_state=state, chunk_size=CHUNK)):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match=r"implementation='flash' is not one of \('auto', 'reference', 'chunked', "
                                       r"'pallas'\)"):
    gated_delta_rule(*tokens, implementation="flash")
  *per_channel, _ = inputs(per_channel=True)
  with pytest.raises(ValueError, match=r"takes one decay per head; a decay per key channel .* runs "
                                       r"implementation='chunked'"):
    gated_delta_rule(*per_channel, implementation="pallas")
  with pytest.raises(ValueError, match=r"GPU gated delta rule needs the chunk, key and value head dims "
                                       r"\(64, 8, 12\) each one of \(16, 32, 64, 128, 256\)"):
    gated_delta_rule_pallas(*tokens, backend="gpu")
  *three_heads, _ = inputs(key_heads=3)
  with pytest.raises(ValueError, match=r"value heads \(4\) must be a multiple of key heads \(3\)"):
    gated_delta_rule(*three_heads)
  q, k, v, g, beta = tokens
  with pytest.raises(ValueError, match=r"g must be \[batch, length, value heads\] = \(2, 37, 4\) .* or "
                                       r"\(2, 37, 4, 8\) \(per key channel\), got shape \(2, 37, 4, 3\)"):
    gated_delta_rule(q, k, v, np.zeros((2, 37, 4, 3), np.float32), beta)


@pytest.mark.parametrize("zigzag, per_channel", [(False, False), (True, False), (True, True)])
def test_split_over_devices_equals_one_device(zigzag, per_channel):
  """LASP-2 over 4 devices (8 pieces zig-zagged): packed segments that start inside a piece
  and exactly at a piece's first token; outputs and gradients equal the one-device door."""
  from functools import partial
  from jax.sharding import PartitionSpec
  from jaxpar.pallas_kernels.attention.layout import unzigzag, zigzag as to_zigzag
  from jaxpar.pallas_kernels.linear_attention.sequence_parallel import gated_delta_rule_split
  q, k, v, g, beta, _ = inputs(7, length=64, per_channel=per_channel)
  segments = jnp.asarray([[0] * 13 + [1] * 19 + [2] * 32, [5] * 40 + [6] * 24], jnp.int32)  # starts at 13, 32, 40
  mesh = jax.make_mesh((4,), ("context",), devices=jax.devices()[:4], axis_types=(jax.sharding.AxisType.Auto,))
  rule = lambda q, k, v, g, b, s0, seg: gated_delta_rule(q, k, v, g, b, initial_state=s0, segment_ids=seg,  # noqa: E731
                                                          chunk_size=4)
  order = (lambda x: to_zigzag(x, 4)) if zigzag else (lambda x: x)
  back = (lambda x: unzigzag(x, 4)) if zigzag else (lambda x: x)
  spec = PartitionSpec(None, "context")

  def split(q, k, v, g, beta):
    local = partial(gated_delta_rule_split, rule, axes=("context",), shards=4, zigzag=zigzag)
    out = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False)(
        *(order(x) for x in (q, k, v, g, beta, segments)))
    return back(out)

  def whole(q, k, v, g, beta):
    return gated_delta_rule(q, k, v, g, beta, segment_ids=segments, chunk_size=4)[0]

  cotangent = np.random.default_rng(8).normal(size=v.shape).astype(np.float32)
  loss = lambda f: lambda *x: jnp.sum(f(*x) * cotangent)  # noqa: E731
  np.testing.assert_allclose(jax.jit(split)(q, k, v, g, beta), whole(q, k, v, g, beta), rtol=1e-5, atol=1e-5)
  got = jax.jit(jax.grad(loss(split), argnums=range(5)))(q, k, v, g, beta)
  want = jax.grad(loss(whole), argnums=range(5))(q, k, v, g, beta)
  for name, a, b in zip("q k v g beta".split(), got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)
