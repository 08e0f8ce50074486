"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5/3): pre-norm GQA + SwiGLU blocks.

Pure model code: arrays carry logical axis names; no mesh axes, no collectives.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.mesh import constrain
from jaxpar.models.attention import Attention
from jaxpar.models.init import embedding_init, fan_in
from jaxpar.models.mlp import MLP
from jaxpar.models.norm import RMSNorm
from jaxpar.models.rope import rope_frequencies

REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "save_dots": jax.checkpoint_policies.checkpoint_dots,
  "save_dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

_ACTIVATION = ("batch", "length", "act_embed")


class DecoderLayer(nnx.Module):
  def __init__(self, cfg, rngs: nnx.Rngs):
    dtypes = dict(param_dtype=jnp.dtype(cfg.param_dtype), compute_dtype=jnp.dtype(cfg.compute_dtype))
    self.attn_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, **dtypes)
    self.attn = Attention(cfg, rngs=rngs, **dtypes)
    self.mlp_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, **dtypes)
    self.mlp = MLP(cfg.embed_dim, cfg.mlp_dim, rngs=rngs, **dtypes)

  def __call__(self, x, positions, segment_ids, inv_freq):
    x = x + self.attn(self.attn_norm(x), positions, segment_ids, inv_freq)
    x = constrain(x, _ACTIVATION)
    x = x + self.mlp(self.mlp_norm(x))
    return constrain(x, _ACTIVATION)


class Llama(nnx.Module):
  def __init__(self, cfg, rngs: nnx.Rngs):
    self.cfg = cfg
    param_dtype, compute_dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
    self.embed = nnx.Param(embedding_init(cfg.embed_dim)(rngs.params(), (cfg.vocab_size, cfg.embed_dim), param_dtype),
                           out_sharding=("vocab", "embed"))
    if cfg.scan_layers:
      # One stacked layer with a leading `layers` axis: compile time stays flat in depth.
      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      def stacked(rngs):
        return DecoderLayer(cfg, rngs)
      self.layers = stacked(rngs)
    else:
      self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=param_dtype,
                              compute_dtype=compute_dtype)
    if not cfg.tie_embeddings:
      self.unembed = nnx.Param(fan_in()(rngs.params(), (cfg.embed_dim, cfg.vocab_size), param_dtype),
                               out_sharding=("embed", "vocab"))

  def _layer_fn(self):
    """(layer, x, positions, segment_ids, inv_freq) -> x, rematerialised per config."""
    def apply(layer, x, positions, segment_ids, inv_freq):
      return layer(x, positions, segment_ids, inv_freq)
    if self.cfg.remat == "none":
      return apply
    return nnx.remat(apply, policy=REMAT_POLICIES[self.cfg.remat])

  def __call__(self, tokens, positions=None, segment_ids=None):
    """tokens, positions, segment_ids: int [B, L] -> logits [B, L, vocab] (compute dtype)."""
    x = self.hidden_states(tokens, positions, segment_ids)
    logits = jnp.einsum("ble,ev->blv", x, self.output_projection())
    return constrain(logits, ("batch", "length", "act_vocab"))

  def output_projection(self):
    """The [embed, vocab] matrix that turns final hidden states into logits."""
    unembed = self.embed[...].T if self.cfg.tie_embeddings else self.unembed[...]
    return unembed.astype(jnp.dtype(self.cfg.compute_dtype))

  def hidden_states(self, tokens, positions=None, segment_ids=None):
    """Final-normed hidden states [B, L, embed]: the logits before the output projection,
    for losses that never materialise the full [B, L, vocab] logits."""
    cfg = self.cfg
    dtype = jnp.dtype(cfg.compute_dtype)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    # Gather rows from a table split only by vocab: each device looks up the rows it holds
    # and the partial results are summed, instead of resharding the whole table.
    table = constrain(self.embed[...].astype(dtype), ("vocab", "act_embed"))
    x = constrain(table[tokens], _ACTIVATION)
    layer_fn = self._layer_fn()
    if cfg.scan_layers:
      graphdef, stacked = nnx.split(self.layers)

      def body(x, layer_state):
        return layer_fn(nnx.merge(graphdef, layer_state), x, positions, segment_ids, inv_freq), None
      x, _ = jax.lax.scan(body, x, stacked, unroll=cfg.scan_unroll)
    else:
      for layer in self.layers:
        x = layer_fn(layer, x, positions, segment_ids, inv_freq)
    return self.final_norm(x)
