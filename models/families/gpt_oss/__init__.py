"""The GPT-OSS family (OpenAI's gpt-oss-20b / 120b): the generic `Transformer` with `mlp:
moe` layers, as a set of config defaults on the shared blocks:

- attention: GQA with biases on q, k, v and o and a learned sink logit per head; sliding
  (128 keys) and full layers alternate; YaRN RoPE (x32 over 4096 positions);
- experts: a biased softmax router (top-k of the biased logits, weights renormalised over
  the k), biased gate/up/down projections and the clamped SwiGLU (models/moe.py).

FLOPs per token count only the experts a token visits (models/flops.py); HF import and
export in hf.py beside this file.
"""

from jaxpar.models.families.gpt_oss import hf
from jaxpar.models.families.gpt_oss.config import GptOssConfig
from jaxpar.models.flops import moe_train_flops_per_token
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

register_family(ModelFamily(name="gpt_oss", module=Transformer, flops_per_token=moe_train_flops_per_token,
                            config=GptOssConfig, rules="fsdp_tp", hf=hf.MAPPING))
