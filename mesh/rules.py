"""Logical-axis rules: which mesh axes each logical array axis is split over.

Parameters use `embed, heads, kv_heads, head_dim, mlp, vocab, layers, experts`; activations
use `batch, length` and `act_*` names, so that a parameter's `embed` can live on `fsdp`
while an activation's batch uses the same mesh axis; the KV cache uses `cache_*` names.

The `expert` mesh axis holds different tokens (it splits the batch) and, in every preset,
different experts (`experts`, expert parallelism): MoE layers send each token to the
devices holding its experts. Outside the experts it acts as more FSDP where FSDP is on.

`length` is split over `context` (context parallelism). `residual_length` is the length
of the residual stream between blocks: split like `length`, and with Megatron sequence
parallelism (`parallel.sequence_parallel`, `sequence_parallel_rules`) over `tensor` too, so
norms and residual adds are not repeated on every tensor device; XLA all-gathers it
before the column-parallel matmuls and reduce-scatters after the row-parallel ones.
FSDP presets also split parameters over `context` (after `fsdp` and `expert`): those devices hold the same weights,
so they share the storage like any other data-parallel replica.
"""

from jaxpar.errors import ConfigError

# Batch is split over every axis that holds different data.
_BATCH = ("data", "fsdp", "expert")

_COMMON = (
  ("batch", _BATCH),
  ("length", "context"),
  ("residual_length", "context"),
  ("act_embed", None),
  ("head_dim", None),
  ("norm", None),
  ("q_lora", None),  # multi-head latent attention's query and key/value latents
  ("kv_lora", None),
  ("layers", None),
  ("cache_pages", None),  # KV-cache pages: one pool, indexed by every sequence's page table
  ("experts", "expert"),  # MoE expert weights: expert parallelism
)

_TENSOR = (
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
  ("act_heads", "tensor"),
  ("act_kv_heads", "tensor"),
  ("act_mlp", "tensor"),
  ("act_vocab", "tensor"),
  ("cache_kv_heads", "tensor"),
)

_NO_TENSOR = tuple((name, None) for name, _ in _TENSOR)
_FSDP = (("embed", ("fsdp", "expert", "context")),)

PRESETS = {
  # Plain data parallelism: every device holds all parameters (ZeRO-0).
  "dp": _COMMON + (("embed", None),) + _NO_TENSOR,
  # ZeRO-3 / FSDP: parameters and optimizer state split over fsdp, gathered per layer.
  "fsdp": _COMMON + _FSDP + _NO_TENSOR,
  # Megatron tensor parallelism: column/row-split heads and MLP, vocab-split embedding.
  "tp": _COMMON + (("embed", None),) + _TENSOR,
  # Both; the default, since size-1 axes make either part a no-op.
  "fsdp_tp": _COMMON + _FSDP + _TENSOR,
}


def resolve_rules(rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """A preset name or an explicit list of (logical, mesh axes) -> normalized rules."""
  if isinstance(rules, str):
    if rules not in PRESETS:
      raise ConfigError(f"mesh.rules={rules!r} is not a preset; use one of {sorted(PRESETS)} "
                       "or a list of [logical_name, mesh_axes] pairs")
    rules = PRESETS[rules]
  normalized = []
  for name, axes in rules:
    if axes is None:
      axes = ()
    elif isinstance(axes, str):
      axes = (axes,)
    normalized.append((name, tuple(axes)))
  table = dict(normalized)
  if "residual_length" not in table and "length" in table:  # lists written before it existed
    normalized.append(("residual_length", table["length"]))
  return tuple(normalized)


def sequence_parallel_rules(rules):
  """Megatron sequence parallelism: the residual stream's length is split over `tensor`
  as well as wherever `length` is split."""
  table = dict(rules)
  split = table.get("length", ()) + ("tensor",)
  return tuple((name, split if name == "residual_length" else axes) for name, axes in rules)


def unused_mesh_axes(rules, axis_sizes: dict[str, int]) -> list[str]:
  """Mesh axes of size > 1 that no rule mentions (their devices would do duplicate work)."""
  used = {axis for _, axes in rules for axis in axes}
  return [a for a, s in axis_sizes.items() if s > 1 and a not in used]
