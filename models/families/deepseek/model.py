"""The `deepseek` family's model: the generic Transformer plus DeepSeek-V3's multi-token
prediction (MTP) at depth 1, an auxiliary training objective.

At each position i the MTP module combines the main stack's output h_i (before the final
norm) with the embedding of the next token t_{i+1}: one projection of [norm(h_i);
norm(emb(t_{i+1}))] back to the model width, one more decoder layer (the stack's own kind),
a norm, and the shared output head predict t_{i+2}. Its cross-entropy, times
`model.mtp_loss_weight`, joins the auxiliary losses (`mtp`), so the train step adds it to
the objective like the router losses.

Generation uses the module only as a speculative draft (jaxpar/inference/mtp.py): its layer
then keeps a paged cache of its own (`init_mtp_cache`, float), entry i written from the pair
(h_i, t_{i+1}) once t_{i+1} is known, and `mtp_decode` steps it.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar import pallas_kernels
from jaxpar.mesh import constrain, num_shards
from jaxpar.models import caches
from jaxpar.models.decoder import RESIDUAL, LayerContext
from jaxpar.models.init import fan_in
from jaxpar.models.layer_pattern import layer_options
from jaxpar.models.norm import RMSNorm
from jaxpar.models.registry import get_block
from jaxpar.models.transformer import Transformer


class MultiTokenPrediction(nnx.Module):
  """Parameters: hidden_norm, embed_norm, merge [2 x embed, embed], layer (a decoder layer
  of the main stack's routed kind), out_norm."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    dtypes = dict(param_dtype=jnp.dtype(cfg.param_dtype), compute_dtype=jnp.dtype(cfg.compute_dtype))
    e = cfg.embed_dim
    self.hidden_norm = RMSNorm(e, eps=cfg.norm_eps, **dtypes)
    self.embed_norm = RMSNorm(e, eps=cfg.norm_eps, **dtypes)
    self.merge = nnx.Param(fan_in()(rngs.params(), (2 * e, e), dtypes["param_dtype"]), out_sharding=(None, "embed"))
    self.layer = get_block("decoder_layer", cfg.layer_block)(cfg, rngs)
    self.out_norm = RMSNorm(e, eps=cfg.norm_eps, **dtypes)
    self.options = layer_options(cfg, cfg.num_layers)  # as a layer after the stack's last
    self.dtype = dtypes["compute_dtype"]

  def __call__(self, hidden, next_embedded, context, cache=None):
    """hidden, next_embedded [B, L, embed] -> (the layer's output [B, L, embed] before
    out_norm, aux, cache); `cache`: a generation cache view of the layer (None: a forward
    over whole sequences)."""
    x = jnp.concatenate([self.hidden_norm(hidden), self.embed_norm(next_embedded)], axis=-1)
    x = constrain(x @ self.merge[...].astype(self.dtype), RESIDUAL)
    return self.layer(x, context, caches.NoCache() if cache is None else cache, self.options)


class DeepSeekTransformer(Transformer):
  """A Transformer with `mtp` (MultiTokenPrediction) when model.mtp_depth is 1."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    super().__init__(cfg, rngs)
    self.mtp = MultiTokenPrediction(cfg, rngs) if cfg.mtp_depth else None

  def hidden_states(self, tokens, positions=None, segment_ids=None, kv_quantization=None, *, zigzag=False):
    x, aux, context = self.stack_output(tokens, positions, segment_ids, kv_quantization, zigzag=zigzag)
    if self.mtp is not None:
      aux = {**aux, "losses": {**aux["losses"], "mtp": self._mtp_loss(x, tokens, context)}}
    return self.final_norm(x), aux

  def _mtp_loss(self, hidden, tokens, context):
    """Mean cross-entropy of predicting t_{i+2} at every position i whose next two tokens
    are in its own document, times model.mtp_loss_weight."""
    segments = context.segment_ids if context.segment_ids is not None else jnp.ones_like(tokens)
    # Shift in natural order: under zig-zag load balancing a row's neighbours are elsewhere.
    shards = num_shards("length") if context.zigzag else 1
    natural = (lambda x: pallas_kernels.unzigzag(x, shards)) if shards > 1 else (lambda x: x)  # noqa: E731
    back = (lambda x: pallas_kernels.zigzag(x, shards)) if shards > 1 else (lambda x: x)  # noqa: E731
    t, s = natural(tokens), natural(segments)
    shift = lambda x, n: jnp.pad(x[:, n:], ((0, 0), (0, n)))  # noqa: E731
    next_tokens, targets = back(shift(t, 1)), back(shift(t, 2))
    valid = back((shift(s, 2) == s) & (jnp.arange(t.shape[1]) < t.shape[1] - 2))
    out, mtp_aux, _ = self.mtp(hidden, self._embed(next_tokens), context)
    logits = jnp.einsum("ble,ev->blv", self.mtp.out_norm(out), self.output_projection()).astype(jnp.float32)
    logits = constrain(logits, ("batch", "length", "act_vocab"))
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    mean = jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    return self.cfg.mtp_loss_weight * mean + sum(mtp_aux.get("losses", {}).values())

  # -- the module as a speculative draft (jaxpar/inference/mtp.py) ------------------------

  def init_mtp_cache(self, num_pages: int, page_size: int, dtype, slots: int) -> dict:
    """A zeroed float paged cache for the module's layer, on the stack's page tables."""
    return caches.init(self.cfg, 1, num_pages, page_size, dtype, slots=slots)

  def mtp_decode(self, hidden, next_tokens, positions, pages: dict, page_table):
    """Write the pairs (hidden [B, T, embed], the token after each, next_tokens [B, T]) at
    `positions` [B, T] (negative: nothing) into the module's cache `pages` and step its layer
    -> (its output [B, T, embed] before out_norm: the next pair's hidden, cache pages)."""
    view = caches.for_generation(pages, page_table, jnp.zeros((), jnp.int32))
    x, _, view = self.mtp(hidden, self._embed(next_tokens), LayerContext(positions), view)
    return x, view.pages

  def mtp_forward(self, tokens):
    """The module's guesses over whole sequences tokens [B, L] -> logits [B, L - 1, vocab],
    at position i its guess of t_{i+2} from (h_i, t_{i+1}): what a draft proposes."""
    x, _, context = self.stack_output(tokens)
    out, _, _ = self.mtp(x[:, :-1], self._embed(tokens[:, 1:]), LayerContext(context.positions[:, :-1]))
    return self.mtp_logits(out)

  def mtp_logits(self, x):
    """The module's guesses [..., vocab] from `mtp_decode`'s output."""
    return self.logits(self.mtp.out_norm(x))
