"""The Qwen3.5 hybrids: Gated DeltaNet linear-attention layers and gated full attention,
three to one. `qwen3_5` (dense), `qwen3_5_moe` and `qwen3_next` (the same mixture-of-experts
model with a sigmoid-gated shared expert, imported from and exported to each one's own
Hugging Face layout).

The generic `Transformer` whose `layer_pattern` gives three of every four layers the
`gated_deltanet` mixer (models/gated_deltanet.py); the full-attention layers are `gqa` with
an output gate, partial rotary (a quarter of head_dim), and q/k norms. Norms multiply by
(1 + scale) as Gemma's do. FLOPs per token count the linear layers' recurrence and, for
the MoE variants, only the experts a token visits (models/flops.py)."""

from jaxpar.models.families.qwen3_5 import hf
from jaxpar.models.families.qwen3_5.config import Qwen35Config, Qwen35MoeConfig, Qwen3NextConfig
from jaxpar.models.flops import dense_train_flops_per_token, moe_train_flops_per_token
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

for _name, _config, _flops, _hf in (("qwen3_5", Qwen35Config, dense_train_flops_per_token, hf.QWEN3_5),
                                    ("qwen3_5_moe", Qwen35MoeConfig, moe_train_flops_per_token, hf.QWEN3_5_MOE),
                                    ("qwen3_next", Qwen3NextConfig, moe_train_flops_per_token, hf.QWEN3_NEXT)):
  register_family(ModelFamily(name=_name, module=Transformer, flops_per_token=_flops, config=_config,
                              rules="fsdp_tp", hf=_hf))
