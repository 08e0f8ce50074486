"""The `model.mla` section: multi-head latent attention's dims, read by the `mla` attention
block (models/mla.py)."""

from pydantic import Field, model_validator

from jaxpar.models.config import Frozen


class MLAConfig(Frozen):
  """Multi-head latent attention (DeepSeek-V2/V3). Queries come through a `q_lora_rank`
  bottleneck (None: one full projection); keys and values of every head are expanded
  from one shared `kv_lora_rank` latent per token, and a `qk_rope_head_dim` part of each
  key, rotated and shared by all heads, carries the position. Queries and keys have
  qk_nope_head_dim + qk_rope_head_dim entries per head, values `v_head_dim`. A generation
  cache stores only the latent and the rotated key: kv_lora_rank + qk_rope_head_dim
  values per token and layer (576 for DeepSeek-V3)."""
  q_lora_rank: int | None = Field(None, ge=1)
  kv_lora_rank: int = Field(64, ge=1)
  qk_nope_head_dim: int = Field(32, ge=1)
  qk_rope_head_dim: int = Field(16, ge=2)
  v_head_dim: int = Field(32, ge=1)
  # DeepSeek's rotary part rotates interleaved pairs (x0, x1), (x2, x3), ... (HF's
  # `rope_interleave`); False: the two halves, as jaxpar's other attention does.
  rope_interleave: bool = True
  latent_norm_eps: float = Field(1e-6, gt=0)  # the q and kv latents' RMSNorms (DeepSeek's default)

  @model_validator(mode="after")
  def _even_rope(self):
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotary pairs)")
    return self

  @property
  def qk_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def latent_dim(self) -> int:
    """Values per token and layer in a latent cache: the latent and the rotated key part."""
    return self.kv_lora_rank + self.qk_rope_head_dim
