"""The `deepseek` family: DeepSeek-V3 (sigmoid scores with the auxiliary-loss-free bias, a
shared expert, dense first layers; `attention_block: mla` for multi-head latent attention,
`model.mla`, else jaxpar's GQA), multi-token prediction (`model.mtp_depth`, model.py), HF
import and export in the DeepseekV3 layout (hf.py). FLOPs per token count only the experts
a token visits (models/flops.py)."""

from jaxpar.models.families.deepseek import hf
from jaxpar.models.families.deepseek.config import DeepSeekConfig
from jaxpar.models.families.deepseek.model import DeepSeekTransformer
from jaxpar.models.flops import moe_train_flops_per_token
from jaxpar.models.registry import ModelFamily, register_family

register_family(ModelFamily(name="deepseek", module=DeepSeekTransformer, flops_per_token=moe_train_flops_per_token,
                            config=DeepSeekConfig, rules="fsdp_tp", hf=hf.MAPPING))
