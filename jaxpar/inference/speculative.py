"""Speculative decoding (Leviathan et al., 2023; Chen et al., 2023), a mode of the engine: a
draft proposes k tokens for every decoding row, the target checks them in one forward pass,
inside continuous batching (requests come and go between rounds as between decode steps).

Each proposed token x is kept with probability min(1, p(x) / q(x)) (p: target, q: draft,
both after temperature / top-k / top-p); at the first rejection the token is drawn from
max(0, p - q) renormalised, and when all k are kept one more comes from the target's next
distribution. The output then follows the target's distribution exactly; greedy rows (one-
hot p and q) give exactly the target's greedy tokens.

A draft is a source of proposals behind one interface (`DraftModel`: a smaller model on the
same tokenizer). The draft model keeps its own paged cache: a request's context is prefilled
into it when the request first decodes, then each round feeds what it lacks (the last token,
and the one before it when every proposal was kept) and proposes k. Positions past what was
accepted hold stale keys and values in both caches, never read (attention stops at each
query's position) and overwritten next round. A round is two compiled programs: the draft's
k proposals (a loop on the device), and the target's pass with the acceptance test.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.inference.pages import page_table_rows
from jaxpar.inference.programs import Kind, settings_extra, settings_struct
from jaxpar.inference.requests import Request
from jaxpar.inference.sampling import filtered_probs, row_arrays, row_keys

_PROPOSE, _ACCEPT, _RESIDUAL = 1, 2, 3  # key streams, apart from the engines' own sampling (0)


def _propose(logits, settings, positions):
  """The draft's distribution at each row's last valid position and a token drawn from it."""
  probs = filtered_probs(logits, settings)
  keys = row_keys(settings, positions, _PROPOSE)
  tokens = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, probs)
  return tokens.astype(jnp.int32), probs


def _draft_round(k, graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings):
  """What the draft's cache lacks, tokens [B, 2] at positions [B, 2] (negative: padding),
  then k proposals, each fed back but the last -> (proposed [B, k], the distributions they
  were drawn from [B, k, V], cache)."""
  model = nnx.merge(graphdef, params, model_state)

  def feed(cache, tokens, positions):
    logits, cache = model.decode(tokens, positions, cache, page_table, kv_quantization=kv, tail_index=rows)
    return logits[:, -1].astype(jnp.float32), cache

  def propose_and_feed(carry, _):
    cache, logits, position = carry
    token, probs = _propose(logits, settings, jnp.maximum(position, 0) + 1)
    position = jnp.where(position >= 0, position + 1, -1)
    logits, cache = feed(cache, token[:, None], position[:, None])
    return (cache, logits, position), (token, probs)

  logits, cache = feed(cache, tokens, positions)
  (cache, logits, position), (fed, fed_probs) = jax.lax.scan(
      propose_and_feed, (cache, logits, positions[:, -1]), length=k - 1)
  last, last_probs = _propose(logits, settings, jnp.maximum(position, 0) + 1)
  proposed = jnp.concatenate([fed.T, last[:, None]], axis=1)
  probs = jnp.concatenate([jnp.moveaxis(fed_probs, 0, 1), last_probs[:, None]], axis=1)
  return proposed, probs, cache


def _target_round(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings,
                  draft_probs, proposed):
  """The target's pass over [last token, *proposed] and the acceptance test -> (accepted
  count [B], the token after them [B], cache)."""
  logits, cache = nnx.merge(graphdef, params, model_state).decode(tokens, positions, cache, page_table,
                                                                  kv_quantization=kv, tail_index=rows)
  target_probs = jax.vmap(filtered_probs, in_axes=(1, None), out_axes=1)(logits.astype(jnp.float32), settings)
  accepted, token = verify(target_probs, draft_probs, proposed, settings, jnp.maximum(positions, 0) + 1)
  return accepted, token, cache


def _draft_program(k):
  return Kind(functools.partial(_draft_round, k), settings_extra, (None, None))


def _target_extra(batch, length, vocab):
  return (settings_struct(batch), jax.ShapeDtypeStruct((batch, length - 1, vocab), jnp.float32),
          jax.ShapeDtypeStruct((batch, length - 1), jnp.int32))


TARGET_PROGRAM = Kind(_target_round, _target_extra, ("rows", "rows"))


def verify(target_probs, draft_probs, proposed, settings, positions):
  """target_probs [B, k+1, V], draft_probs [B, k, V], proposed [B, k] int; positions [B, k+1]:
  where each checked token would go. -> (accepted count [B], the token after them [B])."""
  k = proposed.shape[1]
  p_of = jnp.take_along_axis(target_probs[:, :k], proposed[..., None], axis=-1)[..., 0]
  q_of = jnp.take_along_axis(draft_probs, proposed[..., None], axis=-1)[..., 0]
  keys = jax.vmap(lambda pos: row_keys(settings, pos, _ACCEPT), in_axes=1, out_axes=1)(positions[:, :k])
  uniform = jax.vmap(jax.vmap(jax.random.uniform))(keys)
  keep = uniform * q_of < p_of  # u < p / q, without dividing by a zero q
  accepted = jnp.sum(jnp.cumprod(keep, axis=1), axis=1)
  rows = jnp.arange(proposed.shape[0])
  p_next = target_probs[rows, accepted]
  q_next = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)[rows, accepted]
  residual = jnp.maximum(p_next - q_next, 0.0)
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_next)
  keys = row_keys(settings, positions[rows, accepted], _RESIDUAL)
  token = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r)))(keys, residual)
  return accepted, token.astype(jnp.int32)


class DraftModel:
  """Proposals from `engine`, a smaller model on the target's tokenizer, `k` per round. Its
  engine serves only this draft (its cache holds the target's requests by their slot)."""

  def __init__(self, engine, k: int = 4):
    if k < 1:
      raise ConfigError(f"speculative k={k}: the draft must propose at least one token")
    self.engine, self.k = engine, k
    self.shadows: dict[int, Request] = {}  # target request id -> the draft's copy of it

  def bind(self, target):
    """Check the pair and compile the proposal program for the target's slots."""
    draft, k = self.engine, self.k
    if target.runtime.model_config.vocab_size != draft.runtime.model_config.vocab_size:
      raise ConfigError("the speculative draft and the target must share a vocabulary (and tokenizer)")
    for engine in (target, draft):
      if engine.local_window is not None and k + 1 > engine.local_window:
        raise ConfigError(f"speculative k={k}: a round writes k + 1 positions, more than the local layers' window "
                          f"({engine.local_window}) keeps; use k < {engine.local_window}")
    if target.adapters or draft.adapters:
      raise ConfigError("speculative decoding does not serve stacked adapters: merge the adapter "
                        "(`jaxpar lora merge`) and use the merged model as the target")
    if len(draft.slots) < len(target.slots) or draft.max_seq_len < target.max_seq_len:
      raise ConfigError(f"the draft engine needs the target's {len(target.slots)} slots and context "
                        f"{target.max_seq_len} (it has {len(draft.slots)} and {draft.max_seq_len})")
    self.batch = len(target.slots)
    draft.programs.compile("propose", self.batch, 2, draft.pages_per_seq, _draft_program(k))

  def propose(self, rows, starts, settings):
    """k proposals [B, k] (host) for each row (a target Request or None), and the draft's
    distributions they came from [B, k, V] (device); `starts`: where each row's next token goes."""
    draft, k = self.engine, self.k
    tokens = np.zeros((self.batch, 2), np.int32)
    positions = np.full((self.batch, 2), -1, np.int32)
    shadows = []
    for i, (request, n) in enumerate(zip(rows, starts)):
      shadow = None if request is None else self._admit(request, i)
      shadows.append(shadow)
      if shadow is None:
        continue
      if not draft.pool.grow(shadow.pages, n + k):
        raise RuntimeError("the draft's KV page pool is too small for speculative decoding: raise its num_pages")
      feed = request.context[shadow.cached:n]  # what the draft's cache lacks
      tokens[i, 2 - len(feed):] = feed
      positions[i, 2 - len(feed):] = np.arange(n - len(feed), n)
    table = page_table_rows([s.pages if s else [] for s in shadows], draft.pages_per_seq, draft.pool.num_pages)
    proposed, probs, draft.cache = draft.programs.run(
        "propose", draft.params, draft.model_state, draft.cache, tokens, positions, table,
        np.arange(self.batch, dtype=np.int32), settings)
    return np.asarray(proposed), probs

  def _admit(self, request: Request, row: int) -> Request:
    """The draft's copy of `request`, its context but the last token prefilled on first use."""
    shadow = self.shadows.get(request.id)
    if shadow is None:
      shadow = Request(list(request.context), request.sampling, tuple(request.stop_token_ids))
      shadow.row = row  # the tail page it writes in a quantized cache
      while shadow.prefilling:
        self.engine.prefill([shadow])
      self.shadows[request.id] = shadow
    return shadow

  def advance(self, request: Request, start: int):
    """After a round that started at position `start`: the draft wrote every proposal but the
    last, valid as far as the target kept them."""
    shadow = self.shadows[request.id]
    shadow.cached = min(start + self.k - 1, request.length - 1)
    shadow.generated = request.context[len(shadow.prompt):]

  def forget(self, request: Request):
    """Free the draft's pages of a request that ended or was preempted."""
    shadow = self.shadows.pop(request.id, None)
    if shadow is not None:
      self.engine.pool.release(shadow.pages)


class SpeculativeCalls:
  """The engine's speculative rounds (`Engine` inherits them; `self.draft` proposes)."""

  def _speculate(self) -> list:
    """One round for every slot ready to decode: pages for k more positions each (the newest
    requests preempted if need be), the draft's proposals, the target's check, the tokens
    kept turned into events."""
    k = self.draft.k
    for request in sorted((r for r in self.slots if r is not None and not r.prefilling), key=lambda r: r.arrival):
      if request in self.slots:  # not preempted by an older request's growth
        self._reserve(request, request.length + k)
    rows = [r if r is not None and not r.prefilling else None for r in self.slots]
    starts = [0 if r is None else r.length for r in rows]
    settings = row_arrays([r.sampling if r else None for r in rows])
    proposed, draft_probs = self.draft.propose(rows, starts, settings)
    tokens = np.zeros((len(rows), k + 1), np.int32)
    positions = np.full((len(rows), k + 1), -1, np.int32)
    for i, (request, n) in enumerate(zip(rows, starts)):
      if request is not None:
        tokens[i] = [request.last_token, *proposed[i]]
        at = np.arange(n - 1, n + k)
        positions[i] = np.where(at < self.max_seq_len, at, -1)  # past the context: written nowhere
    table = page_table_rows([r.pages if r else [] for r in rows], self.pages_per_seq, self.pool.num_pages)
    accepted, bonus, self.cache = self._run("speculate", tokens, positions, table,
                                            np.arange(len(rows), dtype=np.int32), settings, draft_probs, proposed)
    accepted, bonus = np.asarray(accepted).tolist(), np.asarray(bonus).tolist()
    events = []
    for i, (request, n) in enumerate(zip(rows, starts)):
      if request is None:
        continue
      request.proposed += k
      request.accepted += accepted[i]
      self.stats["speculative_rounds"] += 1
      for token in [*proposed[i, :accepted[i]].tolist(), bonus[i]]:
        request.cached = request.length
        self.sharing.publish(request)
        events.append(self._deliver(request, request.accept(token, 0.0, self.tokenizer.decode, self.max_seq_len)))
        if request.finish_reason is not None:
          self._free(request)
          break
      else:
        self.draft.advance(request, n)
    self.stats["speculative_proposed"] += k * sum(r is not None for r in rows)
    self.stats["speculative_accepted"] += sum(a for a, r in zip(accepted, rows) if r is not None)
    return events
