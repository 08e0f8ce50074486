"""The Gemma families: Gemma 2 and Gemma 3 (text).

Both are the generic `Transformer` with the `sandwich_norm` decoder layer (a norm before
and after each block), GeGLU, embeddings scaled by sqrt(embed_dim), RMSNorms that multiply
by (1 + scale) and attention scaled by query_pre_attn_scalar ** -0.5. What tells them
apart is a config default:

- gemma2: local (4096-key window) and global layers alternate; attention logits are
  soft-capped at 50 and the output logits at 30.
- gemma3: five local layers (1024 keys, RoPE base 10k) to one global (base 1M, linear
  scaling x8), QK-norm, no soft-capping.
"""

from jaxpar.models.families.gemma import hf, layer  # noqa: F401  (layer registers `sandwich_norm`)
from jaxpar.models.families.gemma.config import Gemma2Config, Gemma3Config
from jaxpar.models.flops import dense_train_flops_per_token
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

for _name, _config, _hf in (("gemma2", Gemma2Config, hf.GEMMA2), ("gemma3", Gemma3Config, hf.GEMMA3)):
  register_family(ModelFamily(name=_name, module=Transformer, flops_per_token=dense_train_flops_per_token,
                              config=_config, rules="fsdp_tp", hf=_hf))
