"""The `model` section of mixture-of-experts families: `ModelConfig` plus `model.moe`."""

from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from jaxpar.models.activations import check_activation
from jaxpar.models.config import Frozen, ModelConfig


# models/activations.py: silu (SwiGLU), clamped_swiglu (GPT-OSS), ...; configs written before
# the one table called silu "swiglu".
ExpertActivation = Annotated[str, BeforeValidator(lambda v: "silu" if v == "swiglu" else v),
                             AfterValidator(check_activation)]


class MoEConfig(Frozen):
  """Routed experts (and optional shared experts) of the `mlp: moe` layers."""
  num_experts: int = Field(8, ge=1)
  experts_per_token: int = Field(2, ge=1)  # top-k
  expert_mlp_dim: int = Field(256, ge=1)  # hidden width of each routed expert
  shared_mlp_dim: int = Field(0, ge=0)  # an always-on SwiGLU of this width (0: none; DeepSeek)
  # The shared expert's output times sigmoid(x . w), w [embed] learned (Qwen3-Next, Qwen3.5 MoE).
  shared_gate: bool = False
  # softmax over all experts (Mixtral, Qwen3-MoE) or independent sigmoids (DeepSeek-V3).
  router: Literal["softmax", "sigmoid"] = "softmax"
  normalize_weights: bool = True  # the top-k weights sum to 1 (Qwen3's norm_topk_prob)
  routed_scale: float = Field(1.0, gt=0)  # multiplies the routed output (DeepSeek-V3: 2.5)
  # Node-limited routing (DeepSeek-V3): the experts form `num_groups` equal groups (one per
  # node); a token first picks `groups_per_token` groups by the sum of each group's two best
  # biased scores, then its top-k among their experts. 1 group: plain top-k.
  num_groups: int = Field(1, ge=1)
  groups_per_token: int = Field(1, ge=1)
  balance_loss: float = Field(0.01, ge=0)  # weight of the load-balancing loss (Switch)
  router_z_loss: float = Field(0.001, ge=0)  # weight of mean(logsumexp(router logits)^2)
  # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the scores that pick the
  # experts (not on the weights), moved by this much per forward pass towards equal load.
  bias_update_rate: float = Field(0.0, ge=0)
  # None: dropless. Else each expert takes at most ceil(factor x tokens x k / experts) of a
  # device's token-assignments; the rest are dropped (metric moe/dropped).
  capacity_factor: float | None = Field(None, gt=0)
  # Expert parallelism without capacity: the all-to-all buffer per destination device, as a
  # multiple of a balanced share (tokens x k / mesh.expert). None: big enough for anything.
  ep_buffer_factor: float | None = Field(None, gt=0)
  # The grouped SwiGLU (pallas_kernels/moe/grouped.py). auto: blocked, or every expert where
  # that is no more work than padded blocks (decode's few tokens).
  implementation: Literal["auto", "blocked", "ragged", "reference"] = "auto"
  # GPT-OSS: a learned bias on the router logits (it steers the choice and the weights), a
  # bias on every expert's gate, up and down projections, and its clamped SwiGLU: gate
  # clamped above at swiglu_limit, up to +-swiglu_limit, then (up + 1) * gate * sigmoid(
  # swiglu_alpha * gate).
  router_bias: bool = False
  expert_bias: bool = False
  activation: ExpertActivation = "silu"
  swiglu_limit: float = Field(7.0, gt=0)
  swiglu_alpha: float = Field(1.702, gt=0)

  @model_validator(mode="after")
  def _top_k(self):
    if self.shared_gate and not self.shared_mlp_dim:
      raise ValueError("model.moe.shared_gate gates the shared expert: set model.moe.shared_mlp_dim too")
    if self.experts_per_token > self.num_experts:
      raise ValueError(f"model.moe.experts_per_token={self.experts_per_token} exceeds "
                       f"model.moe.num_experts={self.num_experts}")
    if self.num_experts % self.num_groups or self.groups_per_token > self.num_groups:
      raise ValueError(f"model.moe.num_groups={self.num_groups} must divide model.moe.num_experts="
                       f"{self.num_experts}, and model.moe.groups_per_token={self.groups_per_token} "
                       "may not exceed it")
    if self.experts_per_token > self.groups_per_token * (self.num_experts // self.num_groups):
      raise ValueError(f"model.moe.experts_per_token={self.experts_per_token} exceeds the experts of "
                       f"model.moe.groups_per_token={self.groups_per_token} groups")
    return self


class MoEModelConfig(ModelConfig):
  """A decoder whose feed-forward blocks are mixtures of experts (`model.first_dense_layers`
  keeps the first layers dense, with `mlp_dim`)."""
  mlp: str = "moe"
  moe: MoEConfig = MoEConfig()

  @model_validator(mode="after")
  def _float_experts(self):
    # Quantization covers the attention and dense projections, not expert weights (yet): a
    # quantized MoE model would keep most of its bytes in float without saying so.
    if self.quantization is not None:
      raise ValueError(f"model.quantization.mode={self.quantization.mode}: mixture-of-experts models "
                       "cannot be quantized yet (expert weights have no quantized kernel); keep them float")
    return self
