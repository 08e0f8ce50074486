"""Causal language-model loss over packed sequences, with optional z-loss."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.mesh import constrain, num_shards
from jaxpar.mesh.length_chunks import length_spans, merge_length, split_length


def causal_lm_loss(logits, targets, loss_mask, z_loss: float = 0.0):
  """Summed (not averaged) so microbatches add up exactly.

  Returns (objective_sum, {"ce_sum", "z_sum", "tokens"}). The target logit is picked with a
  one-hot product rather than a gather so a vocab-sharded logits array stays sharded.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1)
  mask = loss_mask.astype(jnp.float32)
  ce_sum = jnp.sum((log_z - target_logit) * mask)
  # z-loss (PaLM) keeps log Z near 0, which stabilises large-scale bf16 training.
  z_sum = z_loss * jnp.sum(jnp.square(log_z) * mask)
  return ce_sum + z_sum, {"ce_sum": ce_sum, "z_sum": z_sum, "tokens": jnp.sum(mask)}


_PROJECTION = ("act_embed", "act_vocab")  # embed gathered, vocab split as the logits are
# One partial gradient per batch shard and sequence span, each on its own devices:
# [shards, spans, embed, vocab].
_PARTIALS = ("batch", "length", "act_embed", "act_vocab")
_PARAMETER = ("embed", "vocab")  # the output projection's own layout (either orientation)


def chunk_length(length: int, target: int) -> int:
  """The largest divisor of `length` not above `target`."""
  return max(d for d in range(1, min(length, target) + 1) if length % d == 0)


def _batch_shards(batch: int) -> int:
  """Devices the batch is split over in the current mesh (1 outside one)."""
  shards = num_shards("batch")
  return shards if batch % shards == 0 else 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def fused_lm_loss(hidden, projection, targets, loss_mask, z_loss: float = 0.0, chunk_len: int = 128,
                  logit_soft_cap: float | None = None):
  """`causal_lm_loss(hidden @ projection, ...)` without ever holding the [B, L, vocab] logits
  (soft-capped first, cap * tanh(logits / cap), with `logit_soft_cap`: Gemma 2).

  Scans over `chunk_len` positions at a time; each chunk's logits give its loss *and*
  its gradients at once (softmax - one_hot), so the backward pass is two scaled copies.
  Same FLOPs as the plain loss; the logits never leave a chunk, which on CPU also saves
  the page faults of a fresh 100+ MB buffer every step.

  The projection's gradient is summed over chunks per batch shard (each device adds up its
  own rows, no communication) and reduced across devices once, after the last chunk,
  straight into the parameter's layout: one reduce-scatter per step, not one all-reduce
  per chunk.
  """
  return _fused_forward(hidden, projection, targets, loss_mask, z_loss, chunk_len, logit_soft_cap)[0]


def _fused_forward(hidden, projection, targets, loss_mask, z_loss, chunk_len, logit_soft_cap):
  batch, length, embed = hidden.shape
  # When the mesh splits the length (context parallelism), each chunk takes chunk_len
  # positions from every device's own span of the sequence: no hidden state moves, and
  # the chunk count (one projection-gradient reduction each) is what it is unsplit.
  spans = length_spans(length)
  chunk = chunk_length(length // spans, chunk_len)
  count = length // spans // chunk
  shards = _batch_shards(batch)
  # Gather the (FSDP-split) projection once, not once per chunk inside the loop.
  projection = constrain(projection, _PROJECTION)

  def per_shard(x):  # [B, spans, chunk, ...] -> [shards, B / shards, spans, chunk, ...]
    return x.reshape(shards, batch // shards, *x.shape[1:])

  def terms(inputs):  # one chunk -> (its projection-gradient partials, per-chunk outputs)
    h, t, m = inputs
    flat = lambda x: x.reshape(batch, spans * chunk, *x.shape[3:])  # noqa: E731
    logits = constrain(jnp.einsum("ble,ev->blv", flat(h), projection, preferred_element_type=jnp.float32),
                       ("batch", "length", "act_vocab"))
    if logit_soft_cap is not None:
      logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
    t, m = flat(t), flat(m)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    one_hot = jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
    m = m.astype(jnp.float32)
    ce = jnp.sum((log_z - jnp.sum(logits * one_hot, -1)) * m)
    z = z_loss * jnp.sum(jnp.square(log_z) * m)
    # d/dlogits of (log_z - target + z_loss * log_z^2), per token, masked.
    probs = jnp.exp(logits - log_z[..., None])
    d_logits = (probs * (1 + 2 * z_loss * log_z)[..., None] - one_hot) * m[..., None]
    if logit_soft_cap is not None:  # through the cap: d tanh = 1 - tanh^2
      d_logits = d_logits * (1 - jnp.square(logits / logit_soft_cap))
    d_logits = d_logits.astype(h.dtype)
    d_hidden = jnp.einsum("blv,ev->ble", d_logits, projection)
    per_span = d_logits.reshape(*h.shape[:3], -1)  # [B, spans, chunk, vocab]
    partials = jnp.einsum("sbple,sbplv->spev", per_shard(h), per_shard(per_span),
                          preferred_element_type=jnp.float32)
    return constrain(partials, _PARTIALS), (ce, z, jnp.sum(m), d_hidden)

  def body(partials, inputs):
    more, outputs = terms(inputs)
    return constrain(partials + more, _PARTIALS), outputs

  chunks = tuple(split_length(x, count, spans) for x in (hidden, targets, loss_mask))
  # The first chunk's partials start the sum. A zero-filled start has no inputs, and XLA may
  # allocate it when the step begins: 4 GiB (f32 [8192, 128256]) held through the forward pass.
  first, first_outputs = terms(jax.tree.map(lambda x: x[0], chunks))
  partials, outputs = jax.lax.scan(body, first, jax.tree.map(lambda x: x[1:], chunks))
  ce, z, tokens, d_hidden = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]),
                                         first_outputs, outputs)
  # The one cross-device reduction, in the compute dtype like every other weight gradient.
  d_projection = constrain(jnp.sum(partials.astype(projection.dtype), axis=(0, 1)), _PARAMETER)
  # Keep only this device's shard from here on. Where the reduction lowers to an all-reduce
  # and a slice (libtpu, on 2-D/3-D tori), the slice would otherwise fuse into the optimizer
  # update and hold the whole gathered gradient (2 GiB for Llama 3 70B) through the backward.
  d_projection = jax.lax.optimization_barrier(d_projection)
  d_hidden = merge_length(d_hidden.reshape(count, batch, spans, chunk, embed))
  ce_sum, z_sum = jnp.sum(ce), jnp.sum(z)
  aux = {"ce_sum": ce_sum, "z_sum": z_sum, "tokens": jnp.sum(tokens)}
  return (ce_sum + z_sum, aux), (d_hidden, d_projection, targets, loss_mask)


def _fused_backward(z_loss, chunk_len, logit_soft_cap, residuals, cotangents):
  d_hidden, d_projection, targets, loss_mask = residuals
  g = cotangents[0]  # metrics in aux carry no gradient
  return ((g * d_hidden).astype(d_hidden.dtype), (g * d_projection).astype(d_projection.dtype),
          np.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(loss_mask))


fused_lm_loss.defvjp(_fused_forward, _fused_backward)
