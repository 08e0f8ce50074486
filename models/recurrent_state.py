"""The fixed-size state a linear-attention layer keeps per sequence while generating.

Where attention keeps every past key and value in pages, a Gated DeltaNet layer keeps per
slot its delta-rule state [value_heads, key_dim, value_dim] (float32: it accumulates over
the whole sequence) and the last `taps - 1` inputs of each short convolution. Stacked over
the group's layers, in the cache layout's name order (layers, heads, slots, ...), so the
heads shard like KV heads and the slots like pages (kv_cache.STACKED_NAMES):

  conv_q, conv_k  [layers, key_heads, slots, taps - 1, key_dim]
  conv_v          [layers, value_heads, slots, taps - 1, value_dim]
  delta           [layers, value_heads, slots, key_dim, value_dim]

A row reads and writes its slot's state (each program's rows name their slots). A row whose
first position is 0 starts a sequence, so it reads zeros, whatever a finished or preempted
request left in the slot; a row with no valid token writes nothing.

Speculative decoding checks a window of tokens of which only the first few are kept, so a
state must not run past them. A round opens candidates (`open_candidates`: per slot, each
state after each of the window's tokens, `<name>_at` [layers, heads, slots, window, ...]),
the layers fill them, and once the acceptance test has counted what is kept `commit`
stores each row's state after its last kept token and drops the candidates.
"""

import jax.numpy as jnp
from flax import struct

CONV = ("conv_q", "conv_k", "conv_v")
STATES = (*CONV, "delta")


def init_states(cfg, num_layers: int, slots: int, dtype) -> dict:
  """Zeroed states for a group of `num_layers` Gated DeltaNet layers and `slots` sequences."""
  g = cfg.gated_deltanet
  history = g.conv_kernel - 1
  conv = lambda heads, dim: jnp.zeros((num_layers, heads, slots, history, dim), dtype)  # noqa: E731
  return {"conv_q": conv(g.num_key_heads, g.key_head_dim), "conv_k": conv(g.num_key_heads, g.key_head_dim),
          "conv_v": conv(g.num_value_heads, g.value_head_dim),
          "delta": jnp.zeros((num_layers, g.num_value_heads, slots, g.key_head_dim, g.value_head_dim), jnp.float32)}


@struct.dataclass
class RecurrentState:
  """One layer's view of its group's stacked states (`init_states`) for rows whose slots
  `slots` [B] names, at positions `positions` [B, T] (negative: padding)."""
  stores_latent = False
  states: dict
  slots: jnp.ndarray
  layer: jnp.ndarray

  @property
  def pages(self) -> dict:
    """The stored arrays, under the name every cache kind gives them (transformer.py)."""
    return self.states

  def at(self, layer) -> "RecurrentState":
    return self.replace(layer=layer)

  def read(self, name: str, positions) -> jnp.ndarray:
    """This layer's `name` state of each row [B, heads, ...]; zeros for a row that starts a
    sequence (its first position is 0)."""
    state = self.states[name][self.layer, :, self.slots]
    fresh = (positions[:, 0] == 0).reshape((-1,) + (1,) * (state.ndim - 1))
    return jnp.where(fresh, jnp.zeros_like(state), state)

  def write(self, updates: dict, positions) -> "RecurrentState":
    """The states with each row's `updates` [B, heads, ...] stored in its slot; rows with no
    valid position store nothing (idle rows may share a slot with a live one)."""
    states = dict(self.states)
    for name, value in updates.items():
      stack = states[name]
      slots = jnp.where(jnp.any(positions >= 0, axis=1), self.slots, stack.shape[2])  # out of range: dropped
      states[name] = stack.at[self.layer, :, slots].set(value.astype(stack.dtype), mode="drop")
    return self.replace(states=states)

  @property
  def speculating(self) -> bool:
    """Whether a speculative round opened candidates (each token's state is kept)."""
    return "delta_at" in self.states


def open_candidates(cache: dict, width: int) -> dict:
  """`cache` (a model's, every group) with zeroed candidates for a window of `width` tokens
  in each linear-attention group."""
  def opened(group):
    return {**group, **{f"{name}_at": jnp.zeros((*group[name].shape[:3], width, *group[name].shape[3:]),
                                                 group[name].dtype) for name in STATES}}
  return {name: opened(group) if "delta" in group else group for name, group in cache.items()}


def commit(cache: dict, kept, positions, slots) -> dict:
  """Each row's states after its last kept token: the candidate at window index `kept` [B]
  (the accepted count: the row's own token, then `kept` drafts) stored in its slot (`slots`
  [B]; rows with no token store nothing); the candidates dropped."""
  def committed(group):
    live = jnp.where(positions[:, 0] >= 0, slots, group["delta"].shape[2])  # out of range: dropped
    out = {name: value for name, value in group.items() if not name.endswith("_at")}
    for name in STATES:
      chosen = group[f"{name}_at"][:, :, slots, kept]  # [layers, heads, B, ...]
      out[name] = group[name].at[:, :, live].set(chosen, mode="drop")
    return out
  return {name: committed(group) if "delta_at" in group else group for name, group in cache.items()}
