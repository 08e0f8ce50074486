"""Speculative decoding (Leviathan et al., 2023; Chen et al., 2023): a small draft model
that shares the tokenizer proposes k tokens, the target checks them in one forward pass.

Each proposed token x is kept with probability min(1, p(x) / q(x)) (p: target, q: draft,
both after temperature / top-k / top-p); at the first rejection the token is drawn from
max(0, p - q) renormalised, and when all k are kept one more comes from the target's next
distribution. The output then follows the target's distribution exactly; greedy rows (one-
hot p and q) give exactly the target's greedy tokens.

Both engines keep their own paged caches. Positions past what was accepted hold stale keys
and values, never read (attention stops at each query's position) and overwritten next round.
A round is two compiled programs: the draft's k proposals (a loop on the device), and the
target's pass with the acceptance test.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import UserError
from jaxpar.inference.pages import page_table_rows
from jaxpar.inference.programs import Kind, settings_extra, settings_struct
from jaxpar.inference.requests import Completion, Request
from jaxpar.inference.sampling import GREEDY, SamplingParams, filtered_probs, row_arrays, row_keys

_PROPOSE, _ACCEPT, _RESIDUAL = 1, 2, 3  # key streams, apart from the engines' own sampling (0)


@dataclasses.dataclass
class SpeculativeStats:
  rounds: int = 0  # target forward passes, counted per sequence
  proposed: int = 0
  accepted: int = 0
  tokens: int = 0  # tokens generated (stops and limits applied)

  @property
  def acceptance_rate(self) -> float:
    return self.accepted / max(self.proposed, 1)

  @property
  def tokens_per_target_step(self) -> float:
    return self.tokens / max(self.rounds, 1)


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


_TARGET_PROGRAM = Kind(_target_round, _target_extra, ("rows", "rows"))


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


class SpeculativeDecoder:
  """Generate with `target`, `draft` proposing `k` tokens per target pass. Both are Engines
  on the same tokenizer, used only by this decoder while it runs."""

  def __init__(self, target, draft, k: int = 4):
    if k < 1:
      raise UserError(f"k={k}: the draft must propose at least one token")
    if target.runtime.model_config.vocab_size != draft.runtime.model_config.vocab_size:
      raise UserError("the draft and target models must share a vocabulary (and tokenizer)")
    for engine in (target, draft):
      if engine.local_window is not None and k + 1 > engine.local_window:
        raise UserError(f"k={k}: a round writes k + 1 positions, more than the local layers' window "
                        f"({engine.local_window}) keeps; use k < {engine.local_window}")
    if target.adapters or draft.adapters:
      raise UserError("speculative decoding does not serve stacked adapters: merge the adapter "
                      "(`jaxpar lora merge`) and use the merged model as the target")
    self.target, self.draft, self.k = target, draft, k
    self.batch = len(target.slots)
    target.programs.compile("speculate", self.batch, k + 1, target.pages_per_seq, _TARGET_PROGRAM)
    draft.programs.compile("propose", self.batch, 2, draft.pages_per_seq, _draft_program(k))
    self.stats = SpeculativeStats()

  def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] = GREEDY) -> list[Completion]:
    """Like Engine.generate; prompts run `target.slots` at a time."""
    settings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    if any(s.logprobs for s in settings):
      raise UserError("logprobs are not reported with speculative decoding: drop logprobs or the draft")
    done = []
    for start in range(0, len(prompts), self.batch):
      done += self._generate_batch(prompts[start:start + self.batch], settings[start:start + self.batch])
    return done

  def _generate_batch(self, prompts, settings):
    requests = [self.target.make_request(p, s) for p, s in zip(prompts, settings)]
    drafts = [Request(r.prompt, r.sampling, tuple(r.stop_token_ids)) for r in requests]
    for row, (request, draft) in enumerate(zip(requests, drafts)):
      request.row = draft.row = row
    for engine, group in ((self.target, requests), (self.draft, drafts)):
      for request in group:
        while request.prefilling:
          engine.prefill([request])
    rows = row_arrays([r.sampling for r in requests] + [None] * (self.batch - len(requests)))
    try:
      while any(r.finish_reason is None for r in requests):
        self._round(requests, drafts, rows)
    finally:
      for engine, group in ((self.target, requests), (self.draft, drafts)):
        for request in group:
          engine.pool.release(request.pages)
    return [r.completion() for r in requests]

  def _round(self, requests, drafts, settings):
    k, live = self.k, [r.finish_reason is None for r in requests]
    starts = [len(r.context) for r in requests]  # n: the next token goes to position n
    for engine, group, extra in ((self.target, requests, k), (self.draft, drafts, k)):
      for request, n, alive in zip(group, starts, live):
        if alive and not engine.pool.grow(request.pages, n + extra):
          raise RuntimeError("the KV page pool is too small for speculative decoding: raise num_pages")
    proposed, draft_probs = self._draft(drafts, live, starts, settings)
    tokens = np.zeros((self.batch, k + 1), np.int32)
    positions = np.full((self.batch, k + 1), -1, np.int32)
    for i, (request, n) in enumerate(zip(requests, starts)):
      if live[i]:
        tokens[i] = [request.context[-1], *proposed[i]]
        positions[i] = np.arange(n - 1, n + k)
    target = self.target
    table = page_table_rows([r.pages for r in requests] + [[]] * (self.batch - len(requests)), target.pages_per_seq,
                            target.pool.num_pages)
    accepted, bonus, target.cache = target.programs.run(
        "speculate", target.params, target.model_state, target.cache, tokens, positions, table,
        np.arange(self.batch, dtype=np.int32), settings, draft_probs, proposed)
    accepted, bonus = np.asarray(accepted), np.asarray(bonus)
    self.stats.rounds += sum(live)
    for i, (request, draft, n) in enumerate(zip(requests, drafts, starts)):
      if not live[i]:
        continue
      self.stats.proposed += k
      self.stats.accepted += int(accepted[i])
      for token in [*proposed[i, :accepted[i]], bonus[i]]:
        request.accept(int(token), 0.0, self.target.tokenizer.decode, self.target.max_seq_len)
        self.stats.tokens += 1
        if request.finish_reason is not None:
          break
      # Valid cache prefixes: the target wrote the last token and all k proposals, the draft
      # all but the last proposal; beyond what was accepted both are stale.
      request.cached = len(request.context) - 1
      draft.cached = min(n + k - 1, len(request.context) - 1)
      draft.generated = list(request.generated)

  def _draft(self, drafts, live, starts, settings):
    """k proposals per live row [B, k] (host), and the draft's distributions they came from."""
    draft = self.draft
    table = page_table_rows([d.pages for d in drafts] + [[]] * (self.batch - len(drafts)), draft.pages_per_seq,
                            draft.pool.num_pages)
    # Catch up: feed what the draft's cache lacks (the last token, and the one before it
    # when every proposal was accepted last round).
    tokens = np.zeros((self.batch, 2), np.int32)
    positions = np.full((self.batch, 2), -1, np.int32)
    for i, (request, n) in enumerate(zip(drafts, starts)):
      if live[i]:
        feed = request.context[request.cached:n]
        tokens[i, 2 - len(feed):] = feed
        positions[i, 2 - len(feed):] = np.arange(n - len(feed), n)
    proposed, probs, draft.cache = draft.programs.run(
        "propose", draft.params, draft.model_state, draft.cache, tokens, positions, table,
        np.arange(self.batch, dtype=np.int32), settings)
    return np.asarray(proposed), probs
