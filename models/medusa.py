"""Medusa draft heads (Cai et al. 2024): extra predictors over a frozen model's last hidden state.

Head i (0-based) reads the final-normed hidden state h_t that the model's own output
projection turns into its guess for token t + 1, and guesses token t + 2 + i:

  h_i     = ResBlock^layers(h_t),  ResBlock(x) = x + SiLU(x W + b)
  logits  = h_i (P + D_i)

P is the model's output projection (frozen) and D_i the head's own [embed, vocab] delta:
Medusa-1 gives each head its own output projection initialised from the model's, which this
is, with the copy's starting value kept in P rather than stored per head. W, b and D start
at zero, so a fresh head repeats the model's next-token guess. With `shared_projection` there
is no D: the heads train only their blocks. Exported in the Medusa project's layout, head
i's projection is P + D_i (jaxpar/convert/medusa.py).

The heads' weights are `MedusaParam`s, so Runtime.adapter_mask tells them from the frozen
model as it tells LoRA adapters. Beside them the heads keep `BaseFingerprint`, a model-state
summary of the base weights they were trained over (`fingerprint`), which serving compares
with the base it is given.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FINGERPRINT_BUCKETS = 16


class MedusaParam(nnx.Param):
  """A draft head's weight: trains over a frozen base (Runtime.adapter_mask)."""


class BaseFingerprint(nnx.Variable):
  """The `fingerprint` of the base weights the heads were trained over (model state: saved
  with the heads, never trained)."""


class MedusaHeads(nnx.Module):
  """`cfg.medusa.heads` heads: blocks w [heads, layers, embed, embed], b [heads, layers, embed];
  projection deltas [heads, embed, vocab] (none with `shared_projection`); all zero at the start."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    del rngs  # every weight starts at zero: a fresh head repeats the model's next-token guess
    heads, layers, embed = cfg.medusa.heads, cfg.medusa.layers, cfg.embed_dim
    self.w = MedusaParam(jnp.zeros((heads, layers, embed, embed), jnp.float32),
                         out_sharding=(None, None, "embed", "mlp"))
    self.b = MedusaParam(jnp.zeros((heads, layers, embed), jnp.float32), out_sharding=(None, None, "mlp"))
    if not cfg.medusa.shared_projection:
      self.delta = MedusaParam(jnp.zeros((heads, embed, cfg.vocab_size), jnp.float32),
                               out_sharding=(None, "embed", "vocab"))
    self.base_fingerprint = BaseFingerprint(jnp.zeros((FINGERPRINT_BUCKETS, 2), jnp.float32))

  @property
  def count(self) -> int:
    return self.w.shape[0]

  def hidden(self, x):
    """Every head's hidden state [..., heads, embed] from the model's final-normed x [..., embed]."""
    h = jnp.broadcast_to(x[..., None, :], (*x.shape[:-1], self.count, x.shape[-1]))
    for layer in range(self.w.shape[1]):
      w, b = self.w[:, layer].astype(x.dtype), self.b[:, layer].astype(x.dtype)
      h = h + jax.nn.silu(jnp.einsum("...ke,kef->...kf", h, w) + b)
    return h

  def projection(self, head: int, base_projection):
    """Head `head`'s [embed, vocab] output projection over the model's own."""
    if not hasattr(self, "delta"):
      return base_projection
    return base_projection + self.delta[head].astype(base_projection.dtype)

  def logits(self, x, base_projection):
    """Every head's logits [..., heads, vocab] at hidden states x [..., embed]: the model's
    projection read once for all heads, each head's delta once."""
    h = self.hidden(x)
    out = h @ base_projection
    if hasattr(self, "delta"):
      out = out + jnp.einsum("...ke,kev->...kv", h, self.delta[...].astype(h.dtype))
    return out


def fingerprint(weights: dict):
  """[FINGERPRINT_BUCKETS, 2] f32: each leaf's sum and sum of squares, leaf i (in the tree's
  sorted order) added into bucket i % FINGERPRINT_BUCKETS. Telling one base from another
  (another model, another checkpoint of training), not a proof of equality."""
  out = jnp.zeros((FINGERPRINT_BUCKETS, 2), jnp.float32)
  for i, leaf in enumerate(jax.tree.leaves(weights)):
    x = leaf.astype(jnp.float32)
    out = out.at[i % FINGERPRINT_BUCKETS].add(jnp.stack([jnp.sum(x), jnp.sum(x * x)]))
  return out


def same_fingerprint(a, b, rtol: float = 1e-4) -> bool:
  """Whether two fingerprints name the same weights, up to summation order (another mesh)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = np.sqrt(np.maximum(a[:, 1], b[:, 1]))  # a sum's size is set by its leaves' norm
  return bool(np.all(np.abs(a[:, 0] - b[:, 0]) <= rtol * (scale + 1e-12))
              and np.allclose(a[:, 1], b[:, 1], rtol=rtol, atol=1e-12))
