"""Per-layer input embeddings (Gemma 4's PLE): every layer gets a small input of its own.

A second embedding table gives each token `num_layers` vectors of `per_layer_input_dim`;
the first embedding, projected to the same shape and RMS-normed, is added to them, and
layer i reads slice i (LayerContext.layer_input). The layer decides what to do with it
(models/families/gemma/gemma4.py gates and projects it into the residual stream).
"""

import jax.numpy as jnp
from flax import nnx

from jaxpar.models.dense import dense
from jaxpar.models.embedding import embed_lookup
from jaxpar.models.init import embedding_init, fan_in
from jaxpar.models.norm import RMSNorm


class PerLayerInputs(nnx.Module):
  """(tokens [B, L], embedded tokens x [B, L, embed]) -> [B, L, layers, per_layer_input_dim]:
  (norm(x @ projection / sqrt(embed)) + table[tokens] * sqrt(dim)) / sqrt(2). Parameters:
  table [per_layer_vocab, layers * dim], projection [embed, layers * dim], norm [dim]."""

  def __init__(self, cfg, rngs: nnx.Rngs):
    layers, dim = cfg.num_layers, cfg.per_layer_input_dim
    dtype, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
    rows = cfg.per_layer_vocab_size or cfg.vocab_size
    self.table = nnx.Param(embedding_init(dim)(rngs.params(), (rows, layers * dim), dtype),
                           out_sharding=("vocab", "embed"))
    self.projection = nnx.Param(fan_in()(rngs.params(), (cfg.embed_dim, layers * dim), dtype),
                                out_sharding=("embed", None))
    self.norm = RMSNorm(dim, eps=cfg.norm_eps, param_dtype=dtype, compute_dtype=self.dtype,
                        unit_offset=cfg.norm_unit_offset)
    self.layers, self.dim = layers, dim

  def __call__(self, tokens, x):
    shape = (*tokens.shape, self.layers, self.dim)
    # The table's scale rounded to the parameters' dtype, as the main embedding's is.
    scale = jnp.asarray(self.dim ** 0.5, self.table.dtype).astype(self.dtype)
    own = embed_lookup(self.table[...].astype(self.dtype), tokens).reshape(shape) * scale
    mixed = dense(x, self.projection, dtype=self.dtype) * x.shape[-1] ** -0.5
    return (self.norm(mixed.reshape(shape)) + own) * 2 ** -0.5
