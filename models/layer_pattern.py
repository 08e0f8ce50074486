"""What each layer of a stack is told at trace time: its attention spec and its RoPE.

`model.layer_pattern` (config.LayerKind entries, cycled by absolute layer index) overrides
the model section's `sliding_window`, `attn_logit_soft_cap`, `rope_theta`, `rope_scaling`
per layer; the result is a static `LayerOptions` per layer, its attention a
`pallas_kernels.AttentionSpec` built once per layer kind. Options never change a layer's
parameters, so a group of layers stays one stack ([layers, ...] arrays) and the scan runs
over units of one period of the pattern, each layer of a unit with its own static options
(`unit_options`): a kernel sees a Python window, not a traced one. A pattern's `mixer` does
change parameters: the layers of each mixer are a stack of their own, interleaved in the
same unit scan (models/transformer.py).
"""

import dataclasses

from jaxpar.models.config import ModelConfig, RopeScaling
from jaxpar.pallas_kernels import AttentionSpec
from jaxpar.models.rope import attention_factor, rope_frequencies

# The model-section fields a pattern entry may override, by the entry's key.
_OVERRIDABLE = ("sliding_window", "attn_logit_soft_cap", "rope_theta", "rope_scaling")


@dataclasses.dataclass(frozen=True)
class Rope:
  theta: float
  scaling: RopeScaling | None = None
  fraction: float = 1.0  # of head_dim that rotates (partial rotary: Qwen3-Next's 0.25)

  def frequencies(self, head_dim: int):
    return rope_frequencies(int(head_dim * self.fraction), self.theta, self.scaling)

  def attention_factor(self) -> float:
    return attention_factor(self.scaling)


@dataclasses.dataclass(frozen=True)
class LayerOptions:
  """One layer's static options. rope None: no rotary embedding (a pattern's `rope: false`)."""
  attention: AttentionSpec
  rope: Rope | None


def layer_options(cfg: ModelConfig, index: int) -> LayerOptions:
  """The options of layer `index` (absolute: counted over every group of the stack)."""
  values = {key: getattr(cfg, key) for key in _OVERRIDABLE}
  use_rope = True
  if cfg.layer_pattern:
    entry = cfg.layer_pattern[index % len(cfg.layer_pattern)]
    values.update({key: getattr(entry, key) for key in _OVERRIDABLE if key in entry.model_fields_set})
    use_rope = entry.rope
  scale = cfg.query_pre_attn_scalar and cfg.query_pre_attn_scalar ** -0.5
  attention = AttentionSpec.of(sliding_window=values["sliding_window"], logit_soft_cap=values["attn_logit_soft_cap"],
                               scale=scale, implementation=cfg.attention, **cfg.attention_options)
  rope = Rope(values["rope_theta"], values["rope_scaling"], cfg.rope_fraction) if use_rope else None
  return LayerOptions(attention, rope)


def layer_mixer(cfg: ModelConfig, index: int) -> str:
  """The token mixer (attention block name) of layer `index`."""
  entry = cfg.layer_pattern[index % len(cfg.layer_pattern)] if cfg.layer_pattern else None
  return (entry and entry.mixer) or cfg.attention_block


def unit_options(cfg: ModelConfig, start: int, count: int) -> list[LayerOptions]:
  """The options of one scan unit of a run of `count` layers whose first is `start`: the
  shortest run of layers whose repetition gives every layer's options and mixer (length 1
  when all agree). The run need not hold whole units: Kimi Linear's first MoE layers repeat
  (linear x 3, full) and end two layers into a unit, which the scan runs as its tail."""
  kinds = [(layer_options(cfg, start + i), layer_mixer(cfg, start + i)) for i in range(count)]
  for length in range(1, count + 1):
    if all(kinds[i] == kinds[i % length] for i in range(count)):
      return [options for options, _ in kinds[:length]]
  raise AssertionError("unreachable: the whole run always repeats")


def sliding_windows(cfg: ModelConfig, indices=None) -> tuple:
  """The sliding window (None: global) of each layer of `indices` (None: every layer)."""
  indices = range(cfg.num_layers) if indices is None else indices
  return tuple(layer_options(cfg, i).attention.sliding_window for i in indices)


def kv_reach(cfg: ModelConfig) -> int | None:
  """How far back any layer's queries see: the largest sliding window when every layer has
  one (keys further back are never read again, so a cache may drop them), else None."""
  windows = sliding_windows(cfg)
  return None if None in windows else max(windows)


def local_window(cfg: ModelConfig) -> int | None:
  """The largest sliding window when local and global layers mix (the local layers' caches
  keep only that much: models/kv_cache_windowed.py), else None."""
  windows = sliding_windows(cfg)
  return max(w for w in windows if w) if None in windows and any(windows) else None
