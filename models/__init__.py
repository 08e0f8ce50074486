"""Pure Flax NNX model code: layers name their array axes and contain no parallelism.

Families (one folder each under `families/`) and blocks (attention, decoder layer,
feed-forward) are registered by name (`registry.py`); importing this package registers the
shipped blocks, every family folder and any installed `jaxpar.families` entry point. Nothing here changes
global Flax behaviour: `build_model` scopes what it needs.
"""

from jaxpar.models import attention, decoder, families, gated_deltanet, mla, mlp, moe  # noqa: F401  (the shared blocks)
from jaxpar.models.attention import Attention
from jaxpar.models.caches import NoCache, SimulatedKVQuantization
from jaxpar.models.config import GatedDeltaNetConfig, LayerKind, ModelConfig, QuantizationConfig, RopeScaling
from jaxpar.models.decoder import DecoderLayer, LayerContext
from jaxpar.models.kv_cache import PagedCache
from jaxpar.models.kv_cache_latent import LatentPagedCache
from jaxpar.models.kv_cache_quantized import QuantizedPagedCache
from jaxpar.models.layer_pattern import (LayerOptions, Rope, kv_reach, layer_options,
                                         local_window)
from jaxpar.models.dense import QuantizedKernel
from jaxpar.models.kv_quant import KVQuantization
from jaxpar.models.mla_config import MLAConfig
from jaxpar.models.mlp import MLP
from jaxpar.models.moe import MoE
from jaxpar.models.moe_config import MoEConfig, MoEModelConfig
from jaxpar.models.registry import (HFMapping, ModelFamily, block_names, build_model, check_blocks,
                                    family_names, get_block, get_family, register_block, register_family)
from jaxpar.models.transformer import Transformer

families.load()

__all__ = ["Attention", "DecoderLayer", "GatedDeltaNetConfig", "HFMapping", "KVQuantization", "LayerContext",
           "LatentPagedCache", "LayerKind", "LayerOptions", "MLAConfig", "MLP", "ModelConfig", "ModelFamily", "MoE", "MoEConfig",
           "MoEModelConfig", "NoCache", "PagedCache", "QuantizationConfig", "QuantizedKernel",
           "QuantizedPagedCache", "Rope", "RopeScaling", "SimulatedKVQuantization", "Transformer",
           "block_names", "build_model", "check_blocks", "family_names", "get_block", "get_family",
           "kv_reach", "layer_options", "local_window", "register_block", "register_family"]
