"""One attention call's options, as one frozen object that every attention path takes: the
doors, the references and every kernel (flash TPU/GPU, chunked, ring, all-gather, paged
decode TPU/GPU/CPU/XLA). A model builds one per layer kind; a new option is a field here,
in the reference, and in the kernels that implement it, and nothing in between.

Masks are objects, in the spirit of JAX's splash-attention masks: which keys a query may
see (masking.py turns a mask into tile masks and the tile ranges kernels skip to).
"""

import dataclasses

import numpy as np

from jaxpar.errors import UserError
from jaxpar.pallas_kernels.attention.block_sizes import BlockSizes

IMPLEMENTATIONS = ("auto", "flash", "reference", "chunked")


@dataclasses.dataclass(frozen=True)
class CausalMask:
  """Each query sees the keys at or before its own position."""
  causal = True
  window = None


@dataclasses.dataclass(frozen=True)
class LocalMask:
  """Causal, and at most `window` keys back, the query's own key included (sliding window)."""
  window: int
  causal = True

  def __post_init__(self):
    if self.window < 1:
      raise UserError(f"sliding_window={self.window} must be >= 1")


@dataclasses.dataclass(frozen=True)
class FullMask:
  """Every key: bidirectional attention (encoders, a prompt that sees itself whole)."""
  causal = False
  window = None


@dataclasses.dataclass(frozen=True)
class TreeMask:
  """Speculative decoding's candidate trees: causal over what the cache held before the pass,
  and among the pass's own queries a tree, query i seeing the pass's key j only when j is i
  or one of its ancestors. `parents`: each query's parent's index in the pass (-1: query 0,
  the root); parents come before their children. Paged attention over a pass's new tokens
  only (`paged_attention`), whose positions are their cache slots, consecutive per row."""
  parents: tuple[int, ...]
  causal = True
  window = None

  def __post_init__(self):
    if not self.parents or self.parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
      raise UserError(f"tree parents={self.parents}: query 0 is the root (-1) and every other query's "
                      "parent comes before it")

  def ancestry(self):
    """[T, T] bool: query i sees the pass's key j (i itself and its ancestors)."""
    ancestry = np.eye(len(self.parents), dtype=bool)
    for i, parent in enumerate(self.parents[1:], 1):
      ancestry[i] |= ancestry[parent]
    return ancestry


Mask = CausalMask | LocalMask | FullMask | TreeMask


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """mask: which keys each query sees; logit_soft_cap: cap * tanh(logits / cap) (Gemma 2);
  scale: the logits' scale (None: head_dim ** -0.5); value_dim: the values are the first
  value_dim entries of each key (multi-head latent attention's latent cache) instead of
  their own array; implementation: "auto" | "flash" | "reference" | "chunked" (dispatch.py
  says what each is); block_sizes: the kernels' tiles (None: the backend's defaults);
  interpret: run the Pallas kernels in interpret mode (set by the doors off TPU and GPU).
  Hashable: kernels specialise on it."""
  mask: Mask = CausalMask()
  logit_soft_cap: float | None = None
  scale: float | None = None
  value_dim: int | None = None
  implementation: str = "auto"
  block_sizes: BlockSizes | None = None
  interpret: bool = False

  def __post_init__(self):
    if self.implementation not in IMPLEMENTATIONS:
      raise UserError(f"attention implementation={self.implementation!r} is not one of {IMPLEMENTATIONS}")
    if self.logit_soft_cap is not None and self.logit_soft_cap <= 0:
      raise UserError(f"logit_soft_cap={self.logit_soft_cap} must be > 0")
    if self.value_dim is not None and self.value_dim < 1:
      raise UserError(f"value_dim={self.value_dim} must be >= 1")

  @classmethod
  def of(cls, *, causal: bool = True, sliding_window: int | None = None, **options) -> "AttentionSpec":
    """The spec of the common options: causal or not, a sliding window or none."""
    if sliding_window is not None and not causal:
      raise UserError("sliding_window is a causal mask: drop it, or causal=False")
    mask = LocalMask(sliding_window) if sliding_window is not None else CausalMask() if causal else FullMask()
    return cls(mask=mask, **options)

  @property
  def causal(self) -> bool:
    return self.mask.causal

  @property
  def sliding_window(self) -> int | None:
    return self.mask.window

  def scale_for(self, head_dim: int) -> float:
    return head_dim ** -0.5 if self.scale is None else self.scale

  def replace(self, **changes) -> "AttentionSpec":
    return dataclasses.replace(self, **changes)
