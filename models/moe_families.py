"""The mixture-of-experts families: the generic `Transformer` with `mlp: moe` layers.

- mixtral: Mixtral 8x7B / 8x22B (softmax top-2 of 8 experts), HF import and export.
- qwen3_moe: Qwen3-MoE (many fine-grained experts, softmax top-k, qk-norm), HF import and export.
- deepseek: DeepSeek-V3 (sigmoid scores with the auxiliary-loss-free bias, a shared
  expert, dense first layers; `attention_block: mla` for multi-head latent attention,
  `model.mla`; else jaxpar's GQA), multi-token prediction (`model.mtp_depth`), HF import
  and export (the DeepseekV3 layout).

FLOPs per token count only the experts a token visits (models/flops.py).
"""

from jaxpar.models import deepseek_hf, moe, moe_hf  # noqa: F401  (registers the `moe` block)
from jaxpar.models.flops import moe_train_flops_per_token
from jaxpar.models.deepseek import DeepSeekTransformer
from jaxpar.models.deepseek_config import DeepSeekConfig
from jaxpar.models.moe_config import MoEModelConfig
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

for _name, _module, _hf, _config in (
    ("mixtral", Transformer, moe_hf.MIXTRAL, MoEModelConfig), ("qwen3_moe", Transformer, moe_hf.QWEN3_MOE, MoEModelConfig),
    ("deepseek", DeepSeekTransformer, deepseek_hf.DEEPSEEK_V3, DeepSeekConfig)):
  register_family(ModelFamily(name=_name, module=_module, flops_per_token=moe_train_flops_per_token,
                              config=_config, rules="fsdp_tp", hf=_hf))
