"""The GPT-OSS family (OpenAI's gpt-oss-20b / 120b): the generic `Transformer` with `mlp:
moe` layers, as a set of config defaults on the shared blocks:

- attention: GQA with biases on q, k, v and o and a learned sink logit per head; sliding
  (128 keys) and full layers alternate; YaRN RoPE (x32 over 4096 positions);
- experts: a biased softmax router (top-k of the biased logits, weights renormalised over
  the k), biased gate/up/down projections and the clamped SwiGLU (models/moe.py).

FLOPs per token count only the experts a token visits (models/flops.py); HF import and
export in models/gpt_oss_hf.py.
"""


from jaxpar.models import gpt_oss_hf
from jaxpar.models.config import LayerKind, RopeScaling
from jaxpar.models.flops import moe_train_flops_per_token
from jaxpar.models.moe_config import ExpertActivation, MoEConfig, MoEModelConfig
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer


class GptOssMoEConfig(MoEConfig):
  """GPT-OSS's experts as defaults, so a config's `moe:` section keeps them."""
  router_bias: bool = True
  expert_bias: bool = True
  activation: ExpertActivation = "clamped_swiglu"
  balance_loss: float = 0.001
  router_z_loss: float = 0.0


class GptOssConfig(MoEModelConfig):
  family: str = "gpt_oss"
  attention_bias: bool = True
  attention_out_bias: bool = True
  attention_sinks: bool = True
  rope_theta: float = 150_000.0
  rope_scaling: RopeScaling | None = RopeScaling(rope_type="yarn", factor=32.0, original_max_position=4096,
                                                 truncate=False)
  layer_pattern: tuple[LayerKind, ...] = (LayerKind(sliding_window=128), LayerKind())
  moe: GptOssMoEConfig = GptOssMoEConfig()


register_family(ModelFamily(name="gpt_oss", module=Transformer, flops_per_token=moe_train_flops_per_token,
                            config=GptOssConfig, rules="fsdp_tp", hf=gpt_oss_hf.GPT_OSS))
