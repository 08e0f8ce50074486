"""The `llama` family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 (pre-norm GQA + SwiGLU).

The module is the generic `Transformer` with the default config: what makes it this
family is its FLOPs per token, its default sharding preset and its Hugging Face mapping.
"""

from jaxpar.models.families.llama import hf
from jaxpar.models.flops import dense_train_flops_per_token
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

register_family(ModelFamily(name="llama", module=Transformer, flops_per_token=dense_train_flops_per_token,
                            rules="fsdp_tp", hf=hf.MAPPING))
