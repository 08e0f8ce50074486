"""Low-rank adapters (LoRA, Hu et al. 2021) on projections, as their own NNX variable type.

An adapted projection computes `dense(x, W) + scale * (x @ A) @ B`, scale = alpha / rank.
A [*in, rank] and B [rank, *out] are `nnx.LoRAParam`s (Flax's variable type for adapters, a
subclass of `nnx.Param`), so the type tells what trains from the frozen base
(Runtime.adapter_mask). They carry the logical names of the input and output axes of the
projection they adapt (the rank axis is never split), so they shard under FSDP and tensor
parallelism as the projection does. A starts small and random, B at zero: a new adapter
changes nothing.

A block keeps its adapters beside its projections, in `block.lora` (`layers.attn.lora.q.a`),
so the base weights keep their paths: a base checkpoint restores into an adapted model, and
the Hugging Face mappings stay as they are. Routed MoE experts (`model.lora.experts`) get a
pair per expert, added to the expert weights each step (`adapted`): routing is unchanged.

For serving, `model.lora.stacked` = n gives every adapter a leading axis of n adapters (slot
0 all zeros: the base alone), and a program traced inside `rows_use_adapters(index)` gives
batch row i the adapter index[i]: each row gathers its own A and B (two thin batched
matmuls), so one compiled step serves any mix of adapters.

Flax's `nnx.LoRA` module is not used: it is 2-D only ([in, rank] @ [rank, out]) while our
projections keep their head axes ([embed, heads, head_dim]); it wraps the base module (which
would move the base weight's path, and so every checkpoint and HF mapping); and it has no
scale and no logical axis names. Its variable type, `nnx.LoRAParam`, is what we keep.
"""

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models.dense import QuantizedKernel

# Each batch row's adapter while a program with stacked adapters is traced (None: not inside one).
_ROW_ADAPTERS = contextvars.ContextVar("lora_row_adapters", default=None)


@contextlib.contextmanager
def rows_use_adapters(index):
  """Trace the model with batch row i using stacked adapter index[i] (int32 [batch])."""
  token = _ROW_ADAPTERS.set(index)
  try:
    yield
  finally:
    _ROW_ADAPTERS.reset(token)


class LoRA(nnx.Module):
  """One projection's adapter: a [*lead, *in, rank], b [*lead, rank, *out], where `lead` is
  the expert axis of expert weights (else empty)."""

  def __init__(self, cfg, in_shape, out_shape, in_names, out_names, *, rngs: nnx.Rngs, lead=(), lead_names=(),
               per_row: bool = False):
    bound = 1 / math.sqrt(math.prod(in_shape))  # as PEFT's kaiming-uniform(a=sqrt(5)) on [rank, in]
    a = jax.random.uniform(rngs.params(), (*lead, *in_shape, cfg.rank), jnp.float32, -bound, bound)
    self.a = nnx.LoRAParam(a, out_sharding=(*lead_names, *in_names, None))
    self.b = nnx.LoRAParam(jnp.zeros((*lead, cfg.rank, *out_shape), jnp.float32),
                           out_sharding=(*lead_names, None, *out_names))
    self.scale = cfg.scale
    self.contract = len(in_shape)
    self.per_row = per_row  # `lead` is a stack of adapters, one chosen per batch row

  def __call__(self, x, dtype=None):
    """The adapter's term for x [..., *in] -> [..., *out], in x's dtype: two thin matmuls,
    never the [in, out] product."""
    if self.per_row:
      return self._per_row(x, dtype)
    a, b = self.a[...], self.b[...]
    if dtype is not None:
      a, b = a.astype(dtype), b.astype(dtype)
    lead, rank = x.shape[:x.ndim - self.contract], a.shape[-1]
    y = (x.reshape(math.prod(lead), -1) @ a.reshape(-1, rank)) @ b.reshape(rank, -1)
    return (y * self.scale).reshape(*lead, *b.shape[1:]).astype(x.dtype)

  def _per_row(self, x, dtype):
    """x [batch, ..., *in]: row i through stacked adapter rows[i] (a [n, *in, rank], b [n, rank, *out])."""
    rows = _ROW_ADAPTERS.get()
    if rows is None or rows.shape != x.shape[:1]:
      raise ValueError("stacked adapters (model.lora.stacked) run inside lora.rows_use_adapters(index), "
                       "with one adapter index per batch row")
    a, b = self.a[...][rows], self.b[...][rows]  # [batch, *in, rank], [batch, rank, *out]
    if dtype is not None:
      a, b = a.astype(dtype), b.astype(dtype)
    batch, rank = x.shape[0], a.shape[-1]
    y = jnp.einsum("bti,bir->btr", x.reshape(batch, -1, math.prod(a.shape[1:-1])), a.reshape(batch, -1, rank))
    y = jnp.einsum("btr,bro->bto", y, b.reshape(batch, rank, -1))
    return (y * self.scale).reshape(*x.shape[:x.ndim - self.contract], *b.shape[2:]).astype(x.dtype)

  def delta(self):
    """scale * A @ B, shaped like the adapted weight [*lead, *in, *out]."""
    return low_rank_delta(self.a[...], self.b[...], self.scale, self.contract)


def low_rank_delta(a, b, scale: float, contract: int):
  """scale * A @ B for a [*lead, *in, rank], b [*lead, rank, *out] with `contract` input axes."""
  lead = a.shape[:a.ndim - contract - 1]
  rank = a.shape[-1]
  product = jnp.matmul(a.reshape(*lead, -1, rank), b.reshape(*lead, rank, -1))
  return scale * product.reshape(*lead, *a.shape[len(lead):-1], *b.shape[len(lead) + 1:])


def _layout(kernel) -> tuple:
  """(in shape, out shape, in names, out names) of a projection weight (float or quantized)."""
  if isinstance(kernel, QuantizedKernel):
    names, contract = kernel.values.get_metadata()["out_sharding"], kernel.contract
    in_shape = kernel.values.shape[:contract]
    if kernel.mode == "int4":  # two values per byte along the last input axis
      in_shape = (*in_shape[:-1], in_shape[-1] * 2)
    out_shape = kernel.out_shape
  else:
    names, contract = kernel.get_metadata()["out_sharding"], kernel.get_metadata().get("contract", 1)
    in_shape, out_shape = kernel.shape[:contract], kernel.shape[contract:]
  return tuple(in_shape), tuple(out_shape), tuple(names[:contract]), tuple(names[contract:])


def adapters(cfg, rngs: nnx.Rngs, **kernels):
  """The adapters of a block's projections (name -> nnx.Param or QuantizedKernel) that
  `cfg` (model.lora, or None) targets: an nnx.Dict, or None when there are none."""
  if cfg is None:
    return None
  stack = dict(lead=(cfg.stacked,), lead_names=(None,), per_row=True) if cfg.stacked else {}
  chosen = {name: LoRA(cfg, *_layout(kernel), rngs=rngs, **stack) for name, kernel in kernels.items()
            if cfg.targets_projection(name)}
  return nnx.Dict(chosen) if chosen else None


def expert_adapters(cfg, rngs: nnx.Rngs, **weights):
  """One adapter per expert for routed expert weights [experts, in, out] (name -> nnx.Param),
  when `cfg.experts`; an nnx.Dict or None."""
  if cfg is None or not cfg.experts:
    return None
  chosen = {}
  for name, weight in weights.items():
    if cfg.targets_projection(name):
      names = weight.get_metadata()["out_sharding"]
      chosen[name] = LoRA(cfg, weight.shape[1:2], weight.shape[2:], names[1:2], names[2:], rngs=rngs,
                          lead=weight.shape[:1], lead_names=names[:1])
  return nnx.Dict(chosen) if chosen else None


def adapter(block_adapters, name: str):
  """The adapter of projection `name` in a block's `lora` (None: it has none)."""
  return None if block_adapters is None or name not in block_adapters else block_adapters[name]


def adapted(weight, block_adapters, name: str):
  """An expert weight array with its adapters' low-rank update added (as is without one)."""
  found = adapter(block_adapters, name)
  return weight if found is None else weight + found.delta().astype(weight.dtype)
