"""The KV cache of a model that mixes sliding-window (local) and global layers (Gemma 2 and
3, GPT-OSS): the global layers keep the page pool, the local layers only their window.

A local layer never reads a key more than its window behind the query. So each slot owns a
ring of `ring_pages` pages per local layer, and block b of the slot's sequence lives in ring
page `slot * ring_pages + b % ring_pages`: the pages fall out of use as the window passes
and are overwritten by the sequence's own later blocks. A write of at most `window`
positions and the window before it span at most `ring_pages` pages, so nothing a query can
see is overwritten (the engine caps its prompt chunks at the window). The ring's page table
is computed on the device from each row's slot, which the engine passes to every program
anyway, so the decode door and the engine's page table (the global layers') are unchanged.

Cache per layer group: {"full": the global layers' pages, "windowed": the local layers'}
each in a plain cache kind's layout (float or quantized), the local ones with slots x
ring_pages pages; a group of local layers only (Gemma 4's, whose global layers are a group
of their own) has no "full" part. `LocalGlobalCache` is this layout as a cache kind (models/caches.py): it
hands each attention call to the part its layer's attention spec says.

Ring pages belong to one slot and are overwritten, so they are never shared: a request
that took a cached prefix's global pages would have no local keys for it. The engine turns
prefix caching off for these models.
"""

import jax.numpy as jnp
from flax import struct


def is_mixed(windows) -> bool:
  """Whether a group whose layers have these sliding windows (None: global) mixes both."""
  return windows is not None and None in windows and any(w is not None for w in windows)


def ring_pages(window: int, page_size: int) -> int:
  """Pages a write of up to `window` positions and the window before it can span."""
  return (2 * window - 2) // page_size + 2


def ring_table(slots, width: int, ring: int):
  """[B, width] page table of each row's ring (`slots` [B]): block b in ring page b % ring."""
  return (slots[:, None] * ring + jnp.arange(width) % ring).astype(jnp.int32)


def page_size(pages: dict) -> int:
  """The page size of a float or quantized layout (its float tail pages: [layers, kv_heads,
  slots, page_size, head_dim])."""
  return (pages["tail_k"] if "tail_k" in pages else pages["k"]).shape[3]


@struct.dataclass
class LocalGlobalCache:
  """One layer's view of a mixed group's cache: `full` and `windowed` views (plain cache
  kinds over the global and the local layers' stacks); `windows` the group's per-layer
  windows, from which each layer's index into its own stack follows."""
  stores_latent = False
  full: object
  windowed: object
  windows: tuple = struct.field(pytree_node=False)

  def at(self, layer) -> "LocalGlobalCache":
    # Layer i is the how-many-eth of its kind: a static table indexed by the traced layer.
    local = [w is not None for w in self.windows]
    index = lambda kind: jnp.asarray([sum(x == kind for x in local[:i]) for i in range(len(local))])  # noqa: E731
    return self.replace(full=self.full.at(index(False)[layer]), windowed=self.windowed.at(index(True)[layer]))

  def update_and_attend(self, q, k, v, context, spec, sinks=None):
    if spec.sliding_window is None:
      out, full = self.full.update_and_attend(q, k, v, context, spec, sinks)
      return out, self.replace(full=full)
    out, windowed = self.windowed.update_and_attend(q, k, v, context, spec, sinks)
    return out, self.replace(windowed=windowed)

  def attend(self, q, context, spec, sinks=None):
    return (self.full if spec.sliding_window is None else self.windowed).attend(q, context, spec, sinks)

  @property
  def pages(self) -> dict:
    return {"full": self.full.pages, "windowed": self.windowed.pages}


@struct.dataclass
class RingsOnly:
  """A group of local layers only: its `windowed` view (a plain cache kind over the rings),
  in the layout a mixed group's cache has."""
  stores_latent = False
  windowed: object

  def at(self, layer) -> "RingsOnly":
    return self.replace(windowed=self.windowed.at(layer))

  def update_and_attend(self, q, k, v, context, spec, sinks=None):
    out, windowed = self.windowed.update_and_attend(q, k, v, context, spec, sinks)
    return out, self.replace(windowed=windowed)

  def attend(self, q, context, spec, sinks=None):
    return self.windowed.attend(q, context, spec, sinks)

  @property
  def pages(self) -> dict:
    return {"windowed": self.windowed.pages}
