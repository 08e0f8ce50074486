"""SwiGLU feed-forward block (Shazeer, 2020), as in Llama: the `dense` block."""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.mesh import constrain
from jaxpar.models.dense import dense, projection
from jaxpar.models.init import fan_in
from jaxpar.models.registry import register_block


class MLP(nnx.Module):
  """down(silu(x @ gate) * (x @ up)): [B, L, embed] -> ([B, L, embed], {}).

  Parameters: gate, up [embed, mlp]; down [mlp, embed] (QuantizedKernels under
  model.quantization). No auxiliary outputs.
  """

  def __init__(self, embed_dim, mlp_dim, *, param_dtype, compute_dtype, rngs: nnx.Rngs,
               quantization=None):
    init, proj = fan_in(), dict(param_dtype=param_dtype, quantization=quantization)
    self.gate = projection(init, rngs.params(), (embed_dim, mlp_dim), ("embed", "mlp"), **proj)
    self.up = projection(init, rngs.params(), (embed_dim, mlp_dim), ("embed", "mlp"), **proj)
    self.down = projection(init, rngs.params(), (mlp_dim, embed_dim), ("mlp", "embed"), **proj)
    self.dtype = compute_dtype

  def __call__(self, x):
    gate = checkpoint_name(dense(x, self.gate, dtype=self.dtype), "mlp_in")
    up = checkpoint_name(dense(x, self.up, dtype=self.dtype), "mlp_in")
    hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
    return checkpoint_name(dense(hidden, self.down, dtype=self.dtype), "mlp_out"), {}


register_block("feed_forward", "dense",
               lambda cfg, **kwargs: MLP(cfg.embed_dim, cfg.mlp_dim, quantization=cfg.quantization,
                                         **kwargs))
