"""The Gemma families: Gemma 2, Gemma 3 and Gemma 4 (text).

Both are the generic `Transformer` with the `sandwich_norm` decoder layer (a norm before
and after each block), GeGLU, embeddings scaled by sqrt(embed_dim), RMSNorms that multiply
by (1 + scale) and attention scaled by query_pre_attn_scalar ** -0.5. What tells them
apart is a config default:

- gemma2: local (4096-key window) and global layers alternate; attention logits are
  soft-capped at 50 and the output logits at 30.
- gemma3: five local layers (1024 keys, RoPE base 10k) to one global (base 1M, linear
  scaling x8), QK-norm, no soft-capping.
- gemma4: Gemma 3's 5:1 pattern with global layers of their own head width and KV heads
  (and values equal to keys), v-norm, unscaled scores, proportional global RoPE, a learned
  scalar per layer, per-layer input embeddings and experts beside the MLP (gemma4.py;
  config.Gemma4Config).
"""

# layer and gemma4 register their blocks (`sandwich_norm`; `gemma4`, `gemma4_global`).
from jaxpar.models.families.gemma import gemma4, hf, hf_gemma4, layer  # noqa: F401
from jaxpar.models.families.gemma.config import Gemma2Config, Gemma3Config, Gemma4Config
from jaxpar.models.flops import dense_train_flops_per_token
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

for _name, _config, _hf, _flops in (("gemma2", Gemma2Config, hf.GEMMA2, dense_train_flops_per_token),
                                    ("gemma3", Gemma3Config, hf.GEMMA3, dense_train_flops_per_token),
                                    ("gemma4", Gemma4Config, hf_gemma4.GEMMA4, gemma4.train_flops_per_token)):
  register_family(ModelFamily(name=_name, module=Transformer, flops_per_token=_flops, config=_config,
                              rules="fsdp_tp", hf=_hf))
