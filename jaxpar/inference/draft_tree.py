"""Candidate trees for Medusa heads (Cai et al. 2024): many continuations checked in one pass.

Each head proposes its k best guesses; a tree combines them. A node is a path of ranks, e.g.
(0, 2): head 0's best guess, then head 1's third best after it. The target checks every node
in one pass over [root, *nodes] (the root is the row's last token), each node seeing the
cache and its own ancestors only (a TreeMask), at the position its depth gives it. The
longest path the acceptance test keeps is the round's output; its nodes' keys and values are
then moved to the slots right after the root (`caches.copy_positions`), the rest never read.

Acceptance keeps the target's distribution exactly. At a node the children are tried in
order, each kept with probability p(x) under the target's distribution there, where every
rejected child's token is first taken out of p (recursive rejection sampling with one-hot
drafts: a proposal is kept with the probability the target gives it among what is left);
when none is kept, the token is drawn from what is left. Greedy rows keep the child equal to
the target's argmax, if any, and take the argmax after the path.

Which nodes: `choose_tree` adds, up to a node budget, the path most likely to be kept
(the product of each step's chance that a head's rank-r guess is right) under measured
per-head, per-rank accuracies (`objectives.medusa.rank_accuracy` on held-out text), or
under `default_accuracy`'s documented guess where none were measured.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.inference.sampling import argmax, filtered_probs, row_keys
from jaxpar.pallas_kernels import TreeMask

_ACCEPT, _RESIDUAL = 2, 3  # key streams, as speculative.verify's


@dataclasses.dataclass(frozen=True)
class DraftTree:
  """`paths`: every node's path of ranks (head 0's first), in breadth-first order, each
  node's parent path among them. Pass index 0 is the root, node i is index i + 1."""
  paths: tuple[tuple[int, ...], ...]

  def __post_init__(self):
    known = {()}
    for path in self.paths:
      if not path or min(path) < 0 or path[:-1] not in known or path in known:
        raise ConfigError(f"medusa tree: node {path} needs its parent {path[:-1]} before it, once, and ranks >= 0")
      known.add(path)
    if [len(p) for p in self.paths] != sorted(len(p) for p in self.paths):
      raise ConfigError("medusa tree: give the nodes breadth first (every depth-1 node, then depth 2, ...)")

  @property
  def nodes(self) -> int:
    return len(self.paths)

  @property
  def depth(self) -> int:
    return max(len(p) for p in self.paths)

  @property
  def top_k(self) -> int:
    """How many guesses of each head the tree reads."""
    return max(max(p) for p in self.paths) + 1

  @functools.cached_property
  def parents(self) -> tuple[int, ...]:
    index = {(): 0, **{p: i + 1 for i, p in enumerate(self.paths)}}
    return (-1, *(index[p[:-1]] for p in self.paths))

  @property
  def mask(self) -> TreeMask:
    return TreeMask(self.parents)

  @property
  def depths(self) -> np.ndarray:
    """[1 + nodes]: each pass index's depth (the root's 0)."""
    return np.array([0, *(len(p) for p in self.paths)], np.int32)

  def node_guesses(self) -> tuple[np.ndarray, np.ndarray]:
    """(head, rank) [nodes] of each node's token: its depth's head, its path's last rank."""
    return (np.array([len(p) - 1 for p in self.paths], np.int32), np.array([p[-1] for p in self.paths], np.int32))

  def children(self) -> np.ndarray:
    """[1 + nodes, most children]: each pass index's children's pass indices, in rank order
    (-1 past the last)."""
    kids = [[] for _ in range(self.nodes + 1)]
    for i, parent in enumerate(self.parents[1:], 1):
      kids[parent].append(i)
    width = max(len(k) for k in kids)
    return np.array([k + [-1] * (width - len(k)) for k in kids], np.int32)


def default_accuracy(heads: int, ranks: int = 8) -> np.ndarray:
  """A guess at [heads, ranks] accuracies where none were measured: head h's best guess right
  0.6 x 0.8^h of the time, each further rank 0.4 times as often as the one before."""
  return np.array([[0.6 * 0.8 ** h * 0.4 ** r for r in range(ranks)] for h in range(heads)])


def choose_tree(accuracy, nodes: int) -> DraftTree:
  """The `nodes` paths most likely to be kept under `accuracy` [heads, ranks] (the chance
  head h's rank-r guess is the right token), grown one node at a time from the root."""
  accuracy = np.asarray(accuracy, np.float64)
  heads, ranks = accuracy.shape
  chosen, frontier = [], {(r,): accuracy[0, r] for r in range(ranks)}
  while frontier and len(chosen) < nodes:
    path = max(frontier, key=lambda p: (frontier[p], [-r for r in p]))
    chance = frontier.pop(path)
    chosen.append(path)
    if len(path) < heads:
      frontier.update({(*path, r): chance * accuracy[len(path), r] for r in range(ranks)})
  return DraftTree(tuple(sorted(chosen, key=lambda p: (len(p), p))))


def verify_tree(tree: DraftTree, logits, tokens, settings, root_positions, limit):
  """The acceptance test over a tree pass. logits [B, 1 + nodes, V] at each pass index;
  tokens [B, 1 + nodes] (the root, then each node's); root_positions [B]: the root's place
  in its sequence; limit [B]: nodes past this index are not candidates (written nowhere).
  -> (accepted count [B], the kept nodes' pass indices [B, depth] (0 past the count),
  the token after them [B])."""
  logits = logits.astype(jnp.float32)

  def greedy():
    accepted, path, token = _walk(tree, tokens, limit, _greedy_step(logits))
    return accepted, path, token.astype(jnp.int32)

  def sampled():
    accepted, path, weights = _walk(tree, tokens, limit, _sampled_step(logits, settings, root_positions))
    return accepted, path, _draw(weights, settings, root_positions, accepted)
  return jax.lax.cond(jnp.any(settings["temperature"] > 0), sampled, greedy)


def _walk(tree, tokens, limit, step):
  """Down the tree from the root: at each depth `step` picks among the current node's
  children (or none) -> (accepted, path, the last step's state: a token [B] or weights [B, V])."""
  batch = tokens.shape[0]
  children = jnp.asarray(tree.children())
  rows = jnp.arange(batch)
  current = jnp.zeros(batch, jnp.int32)
  alive = jnp.ones(batch, bool)
  accepted = jnp.zeros(batch, jnp.int32)
  path, state = [], None
  for depth in range(tree.depth):
    kids = children[current]  # [B, width]
    valid = (kids >= 0) & (kids <= limit[:, None]) & alive[:, None]
    kid_tokens = tokens[rows[:, None], jnp.maximum(kids, 0)]
    found, chosen, stopped = step(current, kid_tokens, kids, valid, depth)
    state = stopped if state is None else jnp.where((alive & ~found).reshape(-1, *[1] * (stopped.ndim - 1)),
                                                   stopped, state)
    alive &= found
    current = jnp.where(alive, chosen, current)
    accepted += alive
    path.append(jnp.where(alive, chosen, 0))
  final = step(current, None, None, None, tree.depth)[2]  # every depth kept: the next token from the last node
  state = jnp.where(alive.reshape(-1, *[1] * (final.ndim - 1)), final, state)
  return accepted, jnp.stack(path, axis=1), state


def _greedy_step(logits):
  best = jax.vmap(argmax, in_axes=1, out_axes=1)(logits)  # [B, 1 + nodes]

  def step(current, kid_tokens, kids, valid, depth):
    want = jnp.take_along_axis(best, current[:, None], axis=1)[:, 0]
    if kids is None:
      return None, None, want
    match = valid & (kid_tokens == want[:, None])
    chosen = jnp.take_along_axis(kids, jnp.argmax(match, axis=1)[:, None], axis=1)[:, 0]
    return jnp.any(match, axis=1), chosen, want
  return step


def _sampled_step(logits, settings, root_positions):
  def step(current, kid_tokens, kids, valid, depth):
    rows = jnp.arange(logits.shape[0])
    weights = filtered_probs(logits[rows, current], settings)
    if kids is None:
      return None, None, weights
    keys = row_keys(settings, root_positions + depth + 1, _ACCEPT)
    found = jnp.zeros(kids.shape[0], bool)
    chosen = jnp.zeros(kids.shape[0], jnp.int32)
    for c in range(kids.shape[1]):
      u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, c)))(keys)  # noqa: B023
      x = kid_tokens[:, c]
      p_x = weights[rows, x]
      try_it = valid[:, c] & ~found
      keep = try_it & (u * jnp.sum(weights, axis=-1) < p_x)  # kept with x's share of what is left
      chosen = jnp.where(keep, kids[:, c], chosen)
      found |= keep
      weights = jnp.where((try_it & ~keep)[:, None], weights.at[rows, x].set(0.0), weights)
    return found, chosen, weights
  return step


def _draw(weights, settings, root_positions, accepted):
  """The token after the kept path from what is left of the target's distribution."""
  weights = jnp.where(jnp.sum(weights, -1, keepdims=True) > 0, weights, 1.0)  # (never empty: p sums to 1)
  keys = row_keys(settings, root_positions + accepted + 1, _RESIDUAL)
  return jax.vmap(lambda key, w: jax.random.categorical(key, jnp.log(w)))(keys, weights).astype(jnp.int32)
