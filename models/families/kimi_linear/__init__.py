"""Kimi Linear (Moonshot AI): a hybrid of Kimi Delta Attention, the gated delta rule with a
decay per key channel (`gated_deltanet` with `variant: kimi`), and multi-head latent
attention with no positional encoding, three to one, over DeepSeek-V3's sigmoid-routed
experts with a shared expert, the first layer dense.

The generic `Transformer`: the pattern gives three of every four layers the linear mixer;
the latent-attention layers take `rope: false`, so their "rotary" key part is only a key
part shared by the heads. HF import and export in Moonshot's tensor names (hf.py). FLOPs per
token count the linear layers' recurrence and only the experts a token visits."""

from jaxpar.models.families.kimi_linear import hf
from jaxpar.models.families.kimi_linear.config import KimiLinearConfig
from jaxpar.models.flops import moe_train_flops_per_token
from jaxpar.models.registry import ModelFamily, register_family
from jaxpar.models.transformer import Transformer

register_family(ModelFamily(name="kimi_linear", module=Transformer, flops_per_token=moe_train_flops_per_token,
                            config=KimiLinearConfig, rules="fsdp_tp", hf=hf.MAPPING))
