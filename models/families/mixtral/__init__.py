"""The `mixtral` family (Mixtral 8x7B / 8x22B: softmax top-2 of 8 experts).

The generic `Transformer` with `mlp: moe` layers (models/moe.py); FLOPs per token count
only the experts a token visits (models/flops.py)."""

from jaxpar.models.families.mixtral import hf
from jaxpar.models.flops import moe_train_flops_per_token
from jaxpar.models.moe_config import MoEModelConfig
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

register_family(ModelFamily(name="mixtral", module=Transformer, flops_per_token=moe_train_flops_per_token,
                            config=MoEModelConfig, rules="fsdp_tp", hf=hf.MAPPING))
