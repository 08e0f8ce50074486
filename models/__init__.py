"""Pure Flax NNX model code: layers name their array axes and contain no parallelism.

Families and blocks are registered by name (`registry.py`); importing this package
registers the shipped ones. Nothing here changes global Flax behaviour: `build_model`
scopes what it needs.
"""

from jaxpar.models import llama, mlp, moe_families  # noqa: F401  (register the shipped families and blocks)
from jaxpar.models.attention import Attention
from jaxpar.models.config import ModelConfig, QuantizationConfig, RopeScaling
from jaxpar.models.decoder import DecoderLayer, LayerContext
from jaxpar.models.dense import QuantizedKernel
from jaxpar.models.kv_quant import KVQuantization
from jaxpar.models.mlp import MLP
from jaxpar.models.moe import MoE
from jaxpar.models.moe_config import MoEConfig, MoEModelConfig
from jaxpar.models.registry import (HFMapping, ModelFamily, block_names, build_model, family_names,
                                    get_block, get_family, register_block, register_family)
from jaxpar.models.transformer import Transformer

__all__ = ["Attention", "DecoderLayer", "HFMapping", "KVQuantization", "LayerContext", "MLP",
           "ModelConfig", "ModelFamily", "MoE", "MoEConfig", "MoEModelConfig", "QuantizationConfig",
           "QuantizedKernel", "RopeScaling", "Transformer", "block_names", "build_model", "family_names",
           "get_block", "get_family", "register_block", "register_family"]
