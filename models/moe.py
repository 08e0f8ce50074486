"""Mixture-of-experts feed-forward block (`model.mlp: moe`): a router picks the top-k of
`num_experts` SwiGLU experts per token, plus optional always-on shared experts.

Pure model code: the experts' weights carry the `experts` logical axis, and the routed
compute (sorting, grouped matmuls, the all-to-all of expert parallelism) happens behind
`jaxpar.pallas_kernels.moe.routed_experts`.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.models import lora, router
from jaxpar.models.dense import dense
from jaxpar.models.activations import gated
from jaxpar.models.init import fan_in
from jaxpar.models.low_precision import low_precision_matmul
from jaxpar.models.mlp import MLP
from jaxpar.models.registry import register_block
from jaxpar.pallas_kernels.moe import routed_experts
from jaxpar.pallas_kernels.moe.grouped import RAGGED_IS_FLOAT_ONLY


class RouterBias(nnx.Variable):
  """Per-expert bias on the scores that choose experts (auxiliary-loss-free balancing).
  Not a parameter: the optimizer never sees it; each training forward pass nudges it."""


class MoE(nnx.Module):
  """[B, L, embed] -> ([B, L, embed], aux).

  Parameters: router [embed, experts]; gate, up [experts, embed, mlp]; down
  [experts, mlp, embed]; with moe.router_bias, router_bias [experts]; with moe.expert_bias,
  gate_bias, up_bias [experts, mlp] and down_bias [experts, embed] (GPT-OSS);
  `shared` (an MLP) when moe.shared_mlp_dim > 0, with moe.shared_gate its gate
  `shared_gate` [embed, 1]; with model.lora, the
  shared MLP's adapters and (lora.experts) one adapter per expert in `lora`. Model state: `bias`
  [experts] when moe.bias_update_rate > 0.
  aux losses: moe_balance, moe_router_z (already weighted); metrics: moe/load (fraction of
  assignments per expert), moe/imbalance (max / mean load), moe/dropped (fraction dropped).
  """

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs: nnx.Rngs):
    m = self.moe = cfg.moe
    if cfg.train_precision != "compute_dtype" and m.implementation == "ragged":
      raise ConfigError(RAGGED_IS_FLOAT_ONLY)
    self.precision = cfg.train_precision
    e, d, f = m.num_experts, cfg.embed_dim, m.expert_mlp_dim
    self.router = nnx.Param(fan_in()(rngs.params(), (d, e), param_dtype), out_sharding=("embed", None))
    expert_init = fan_in(in_axis=1, out_axis=2)  # each expert's own fan-in
    self.gate = nnx.Param(expert_init(rngs.params(), (e, d, f), param_dtype),
                          out_sharding=("experts", "embed", "mlp"))
    self.up = nnx.Param(expert_init(rngs.params(), (e, d, f), param_dtype),
                        out_sharding=("experts", "embed", "mlp"))
    self.down = nnx.Param(expert_init(rngs.params(), (e, f, d), param_dtype),
                          out_sharding=("experts", "mlp", "embed"))
    self.shared = (MLP(d, m.shared_mlp_dim, param_dtype=param_dtype, compute_dtype=compute_dtype,
                       rngs=rngs, adapters=cfg.lora, precision=cfg.train_precision) if m.shared_mlp_dim else None)
    self.shared_gate = (nnx.Param(fan_in()(rngs.params(), (d, 1), param_dtype), out_sharding=("embed", None))
                        if m.shared_gate else None)
    self.lora = lora.expert_adapters(cfg.lora, rngs, gate=self.gate, up=self.up, down=self.down)
    self.bias = RouterBias(jnp.zeros((e,), jnp.float32)) if m.bias_update_rate > 0 else None
    # Biases are offsets, not weights: not decayed (as norm scales and sinks).
    bias = lambda shape, names: nnx.Param(jnp.zeros(shape, param_dtype), out_sharding=names,  # noqa: E731
                                          weight_decay=False)
    self.router_bias = bias((e,), ("experts",)) if m.router_bias else None
    if m.expert_bias:
      self.gate_bias, self.up_bias = bias((e, f), ("experts", "mlp")), bias((e, f), ("experts", "mlp"))
      self.down_bias = bias((e, d), ("experts", "embed"))
    self.expert_bias = m.expert_bias
    self.glu = gated(m.activation, m)
    self.dtype = compute_dtype

  def __call__(self, x):
    return self.mix(x, self.router_logits(x))

  def router_logits(self, x):
    """Router logits [B, L, experts] of tokens x, in float32: near-ties between experts must
    not flip with the compute dtype."""
    logits = dense(x.astype(jnp.float32), self.router[...].astype(jnp.float32))
    if self.router_bias is not None:
      logits = logits + self.router_bias[...].astype(jnp.float32)
    return logits

  def routed_weights(self, ids, weights):
    """The combine weights [B, L, k] of the chosen experts `ids`, as routing gave them."""
    return weights

  def mix(self, x, logits):
    """-> (y, aux): tokens x [B, L, embed] through the experts `logits` choose (and the
    shared expert)."""
    m, dt = self.moe, self.dtype
    ids, weights, scores = router.route(logits, None if self.bias is None else self.bias[...], m)
    weights = self.routed_weights(ids, weights)
    gate, up, down = (lora.adapted(getattr(self, n)[...], self.lora, n).astype(dt) for n in ("gate", "up", "down"))
    biases = (self.gate_bias[...].astype(dt), self.up_bias[...].astype(dt)) if self.expert_bias else None
    y, kept = routed_experts(x, ids, weights, gate, up, down, biases=biases, glu=self.glu,
                             capacity_factor=m.capacity_factor, ep_buffer_factor=m.ep_buffer_factor,
                             implementation=m.implementation, matmul=self._matmul())
    if self.expert_bias:  # each kept expert's down bias, weighted as its output
      used = (weights * kept).astype(dt)
      y = y + jnp.einsum("blk,blkd->bld", used, self.down_bias[...].astype(dt)[ids])
    if self.shared is not None:
      shared = self.shared(x)[0]
      if self.shared_gate is not None:
        shared = shared * jax.nn.sigmoid(dense(x, self.shared_gate[...].astype(dt)))
      y = y + shared
    load = router.load_fractions(ids, m.num_experts)
    if self.bias is not None:
      self.bias[...] = router.updated_bias(self.bias[...], load, m.bias_update_rate)
    losses = {}
    if m.balance_loss:
      losses["moe_balance"] = m.balance_loss * router.balance_loss(load, scores, m.router)
    if m.router_z_loss:
      losses["moe_router_z"] = m.router_z_loss * router.router_z_loss(logits)
    metrics = {"moe/load": load, "moe/imbalance": jnp.max(load) * m.num_experts,
               "moe/dropped": 1.0 - jnp.mean(kept.astype(jnp.float32))}
    return y, {"losses": losses, "metrics": metrics}


  def _matmul(self):
    """The experts' projection matmul: None (the compute dtype) or model.train_precision's door."""
    if self.precision == "compute_dtype":
      return None
    return functools.partial(low_precision_matmul, scheme=self.precision)


register_block("feed_forward", "moe", MoE)
