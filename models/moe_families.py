"""The mixture-of-experts families: the generic `Transformer` with `mlp: moe` layers.

- mixtral: Mixtral 8x7B / 8x22B (softmax top-2 of 8 experts), HF import and export.
- qwen3_moe: Qwen3-MoE (many fine-grained experts, softmax top-k, qk-norm), HF import and export.
- deepseek: DeepSeek-V3-style blocks (sigmoid scores with the auxiliary-loss-free bias, a
  shared expert, dense first layers) on jaxpar's GQA attention: DeepSeek's multi-head latent
  attention is not implemented, so there is no HF mapping.

FLOPs per token count only the experts a token visits (models/flops.py).
"""

from jaxpar.models import moe, moe_hf  # noqa: F401  (registers the `moe` block)
from jaxpar.models.flops import moe_train_flops_per_token
from jaxpar.models.moe_config import MoEModelConfig
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

for _name, _hf in (("mixtral", moe_hf.MIXTRAL), ("qwen3_moe", moe_hf.QWEN3_MOE), ("deepseek", None)):
  register_family(ModelFamily(name=_name, module=Transformer, flops_per_token=moe_train_flops_per_token,
                              config=MoEModelConfig, rules="fsdp_tp", hf=_hf))
