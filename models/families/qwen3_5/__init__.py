"""The `qwen3_5` family (Qwen3.5 text): a hybrid of Gated DeltaNet linear-attention layers and
gated full attention, three to one.

The generic `Transformer` whose `layer_pattern` gives three of every four layers the
`gated_deltanet` mixer (models/gated_deltanet.py); the full-attention layers are `gqa` with
an output gate, partial rotary (a quarter of head_dim), and q/k norms. Norms multiply by
(1 + scale) as Gemma's do. FLOPs per token count the linear layers' recurrence
(models/flops.py)."""

from jaxpar.models.families.qwen3_5 import hf
from jaxpar.models.families.qwen3_5.config import Qwen35Config
from jaxpar.models.flops import dense_train_flops_per_token
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

register_family(ModelFamily(name="qwen3_5", module=Transformer, flops_per_token=dense_train_flops_per_token,
                            config=Qwen35Config, rules="fsdp_tp", hf=hf.MAPPING))
