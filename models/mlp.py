"""Gated feed-forward block (Shazeer, 2020): SwiGLU as in Llama, or GeGLU as in Gemma (the
`dense` block, `model.mlp_activation`)."""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.mesh import constrain
from jaxpar.mesh.length_chunks import length_spans, merge_length, split_length
from jaxpar.models import lora
from jaxpar.models import low_precision_delayed as delayed
from jaxpar.models.dense import dense, projection
from jaxpar.models.activations import gated
from jaxpar.models.init import fan_in
from jaxpar.models.registry import register_block
from jaxpar.models.stack import remat_policy

# The weights as every piece of a chunked block reads them: gathered over FSDP once per
# layer (not once per piece), still split over `tensor`.
_GATHERED = {"gate": ("act_embed", "act_mlp"), "up": ("act_embed", "act_mlp"),
             "down": ("act_mlp", "act_embed")}


class MLP(nnx.Module):
  """down(glu(x @ gate, x @ up)): [B, L, embed] -> ([B, L, embed], {}); glu: `activation`'s
  (models/activations.py: SwiGLU, GeGLU).

  Parameters: gate, up [embed, mlp]; down [mlp, embed] (QuantizedKernels under
  model.quantization; their adapters in `lora` under model.lora). No auxiliary outputs.

  chunks > 1 (`model.mlp_chunks`) runs a float block over the sequence in that many pieces,
  one after another, each rematerialised under `remat`: the [tokens, mlp] intermediates the
  backward pass holds at once shrink by that factor. The result is the same; a length the
  pieces do not divide (a decode step) runs whole.
  """

  def __init__(self, embed_dim, mlp_dim, *, param_dtype, compute_dtype, rngs: nnx.Rngs,
               quantization=None, chunks: int = 1, remat="none", adapters=None, activation: str = "silu",
               precision: str = "compute_dtype", amax_history: int = 16):
    init, proj = fan_in(), dict(param_dtype=param_dtype, quantization=quantization)
    self.gate = projection(init, rngs.params(), (embed_dim, mlp_dim), ("embed", "mlp"), **proj)
    self.up = projection(init, rngs.params(), (embed_dim, mlp_dim), ("embed", "mlp"), **proj)
    self.down = projection(init, rngs.params(), (mlp_dim, embed_dim), ("mlp", "embed"), **proj)
    self.lora = lora.adapters(adapters, rngs, gate=self.gate, up=self.up, down=self.down)
    self.dtype, self.glu, self.precision = compute_dtype, gated(activation), precision
    for name in ("gate", "up", "down"):  # fp8_delayed's scaling histories
      setattr(self, f"{name}_{delayed.NAME}", delayed.amax_history(precision, amax_history))
    self.chunks = chunks if quantization is None else 1
    # A piece keeps or recomputes its activations as the layer does.
    self.piece_policy = None if remat == "none" else remat_policy(remat)

  def __call__(self, x):
    spans = length_spans(x.shape[1])
    if self.chunks == 1 or x.shape[1] % (spans * self.chunks):
      return self._feed_forward(x, self.gate, self.up, self.down), {}
    kernels = [constrain(getattr(self, name)[...].astype(self.dtype), names)
               for name, names in _GATHERED.items()]

    def piece(x):  # [B, spans, piece, embed]: each device's own part of its span
      flat = x.reshape(x.shape[0], -1, x.shape[-1])
      return self._feed_forward(flat, *kernels).reshape(x.shape)
    if self.piece_policy is not None:
      piece = jax.checkpoint(piece, policy=self.piece_policy)
    return merge_length(jax.lax.map(piece, split_length(x, self.chunks, spans))), {}

  def _feed_forward(self, x, gate_kernel, up_kernel, down_kernel):
    run = lambda x, kernel, name: dense(x, kernel, dtype=self.dtype, adapter=lora.adapter(self.lora, name),  # noqa: E731
                                        precision=self.precision, history=getattr(self, f"{name}_{delayed.NAME}"))
    gate = checkpoint_name(run(x, gate_kernel, "gate"), "mlp_in")
    up = checkpoint_name(run(x, up_kernel, "up"), "mlp_in")
    hidden = constrain(self.glu(gate, up), ("batch", "length", "act_mlp"))
    return checkpoint_name(run(hidden, down_kernel, "down"), "mlp_out")


register_block("feed_forward", "dense",
               lambda cfg, **kwargs: MLP(cfg.embed_dim, cfg.mlp_dim, quantization=cfg.quantization,
                                         chunks=cfg.mlp_chunks, remat=cfg.remat, adapters=cfg.lora,
                                         activation=cfg.mlp_activation, precision=cfg.train_precision,
                                         amax_history=cfg.fp8_amax_history, **kwargs))
