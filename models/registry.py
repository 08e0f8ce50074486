"""Model families and blocks, registered by name.

A family is one entry: the module that builds the model, its config class (the `model`
section), its FLOPs per token, its default sharding preset and its Hugging Face mapping.
Blocks are the interchangeable parts a config picks, by kind:

  feed_forward   `model.mlp` (dense, moe): factory(cfg, *, param_dtype, compute_dtype, rngs),
                 its module's call (x) -> (y, aux dict)
  attention      `model.attention_block` (gqa, mla): the same factory; its module's call
                 (x, context, cache, options) -> (y, cache), attending through the cache
                 object it is given (models/caches.py) with the layer's static options
                 (models/layer_pattern.py)
  decoder_layer  `model.layer_block` (pre_norm): factory(cfg, rngs, *, feed_forward, mixer), its
                 module's call (x, context, cache, options) -> (x, aux, cache)

Adding a family or a block is a `register_*` call; nothing else in the tree is edited. The
shipped families register from their folders (models/families/); docs/extending.md walks
through adding one.
"""

import dataclasses
from typing import Any, Callable

from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class HFMapping:
  """How a family's parameters and config correspond to a Hugging Face checkpoint.

  `top` and `layer` list (our path, HF tensor name, layout) triples; layer names follow
  `model.layers.{i}.`. Layouts: same, transpose, heads_in, heads_out, heads_bias
  (see jaxpar/convert/hf.py). Entries whose parameter the model lacks are skipped.
  `dense_layer`: the entries of the `model.first_dense_layers` layers, when they differ.
  `model_types` / `config_from_hf`: the HF model types the family imports and how; none:
  export only (a family that writes another's layout, as a toy family writing Llama's).
  `groups`: (layer group, entries) pairs for groups of their own (a hybrid's
  `gated_deltanet_layers`).
  `alternative_names`: (part, other part) pairs: a tensor missing from a checkpoint under its
  name is read under the name with `part` replaced, another writer's spelling (import only).
  """
  config_to_hf: Callable[[ModelConfig, str], dict]
  top: tuple[tuple[tuple[str, ...], str, str], ...]
  layer: tuple[tuple[tuple[str, ...], str, str], ...]
  model_types: tuple[str, ...] = ()
  config_from_hf: Callable[[dict], ModelConfig] | None = None
  dense_layer: tuple[tuple[tuple[str, ...], str, str], ...] | None = None
  groups: tuple[tuple[str, tuple], ...] = ()
  alternative_names: tuple[tuple[str, str], ...] = ()

  def entries(self, group: str) -> tuple:
    """The layer entries of layer group `group` (models/transformer.py layer_groups)."""
    named = dict(self.groups)
    if group in named:
      return named[group]
    return (self.dense_layer or self.layer) if group == "dense_layers" else self.layer


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  name: str
  module: Callable[[Any, nnx.Rngs], nnx.Module]  # (model config, rngs) -> the model
  flops_per_token: Callable[[Any, int], float]  # (model config, seq_len) -> training FLOPs
  config: type[ModelConfig] = ModelConfig
  rules: str = "fsdp_tp"  # the sharding preset used when the config names none
  hf: HFMapping | None = None


_FAMILIES: dict[str, ModelFamily] = {}
# Each block kind and the config key that names it.
BLOCK_KINDS = {"feed_forward": "mlp", "attention": "attention_block", "decoder_layer": "layer_block"}
_BLOCKS: dict[str, dict[str, Callable]] = {kind: {} for kind in BLOCK_KINDS}


def register_family(family: ModelFamily) -> ModelFamily:
  _FAMILIES[family.name] = family
  return family


def family_names() -> list[str]:
  return sorted(_FAMILIES)


def get_family(name: str) -> ModelFamily:
  if name not in _FAMILIES:
    raise ConfigError(f"model.family={name!r} is not a registered family; use one of {family_names()}")
  return _FAMILIES[name]


def register_block(kind: str, name: str, factory: Callable) -> Callable:
  """Register `factory` as block `name` of `kind` (see the module doc for each kind's call)."""
  if kind not in BLOCK_KINDS:
    raise ValueError(f"block kind {kind!r} is not one of {sorted(BLOCK_KINDS)}")
  _BLOCKS[kind][name] = factory
  return factory


def block_names(kind: str) -> list[str]:
  return sorted(_BLOCKS.get(kind, {}))


def get_block(kind: str, name: str) -> Callable:
  blocks = _BLOCKS.get(kind, {})
  if name not in blocks:
    raise ConfigError(f"model.{BLOCK_KINDS.get(kind, kind)}={name!r} is not a registered {kind} block; "
                      f"use one of {block_names(kind)}")
  return blocks[name]


def check_blocks(model_cfg):
  """Every block the model section names is registered (one-line ConfigError if not)."""
  for kind, key in BLOCK_KINDS.items():
    get_block(kind, getattr(model_cfg, key))
  for i, entry in enumerate(model_cfg.layer_pattern):
    if entry.mixer and entry.mixer not in _BLOCKS["attention"]:
      raise ConfigError(f"model.layer_pattern[{i}].mixer={entry.mixer!r} is not a registered attention block; "
                        f"use one of {block_names('attention')}")


def build_model(model_cfg, rngs: nnx.Rngs) -> nnx.Module:
  """The family's module for `model_cfg`. Flax's eager sharding stays off while it is built:
  jaxpar places parameters itself (jit out_shardings from jaxpar.mesh), and eager placement
  would need a mesh at every construction."""
  with nnx.use_eager_sharding(False):
    return get_family(model_cfg.family).module(model_cfg, rngs)
