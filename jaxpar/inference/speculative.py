"""Speculative decoding (Leviathan et al., 2023; Chen et al., 2023): a small draft model
that shares the tokenizer proposes k tokens, the target checks them in one forward pass.

Each proposed token x is kept with probability min(1, p(x) / q(x)) (p: target, q: draft,
both after temperature / top-k / top-p); at the first rejection the token is drawn from
max(0, p - q) renormalised, and when all k are kept one more comes from the target's next
distribution. The output then follows the target's distribution exactly; greedy rows (one-
hot p and q) give exactly the target's greedy tokens.

Both engines keep their own paged caches. Positions past what was accepted hold stale keys
and values, never read (attention stops at each query's position) and overwritten next round.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.inference.pages import page_table_rows
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


@jax.jit
def _propose(logits, settings, positions):
  """The draft's distribution at each row's last valid position and a token drawn from it."""
  probs = filtered_probs(logits, settings)
  keys = row_keys(settings, positions, _PROPOSE)
  tokens = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, probs)
  return tokens.astype(jnp.int32), probs


@jax.jit
def _target_probs(logits, settings):
  return jax.vmap(filtered_probs, in_axes=(1, None), out_axes=1)(logits, settings)


@jax.jit
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
      raise ValueError(f"k={k}: the draft must propose at least one token")
    if target.runtime.model_config.vocab_size != draft.runtime.model_config.vocab_size:
      raise ValueError("the draft and target models must share a vocabulary (and tokenizer)")
    self.target, self.draft, self.k = target, draft, k
    self.batch = len(target.slots)
    for engine, lengths in ((target, (k + 1,)), (draft, (1, 2))):
      for length in lengths:
        engine.programs.compile("score", self.batch, length, engine.pages_per_seq)
    self.stats = SpeculativeStats()

  def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] = GREEDY) -> list[Completion]:
    """Like Engine.generate; prompts run `target.slots` at a time."""
    settings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    if any(s.logprobs for s in settings):
      raise ValueError("logprobs are not reported with speculative decoding: drop logprobs or the draft")
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
    proposed, draft_probs = self._draft(requests, drafts, live, starts, settings)
    tokens = np.zeros((self.batch, k + 1), np.int32)
    positions = np.full((self.batch, k + 1), -1, np.int32)
    for i, (request, n) in enumerate(zip(requests, starts)):
      if live[i]:
        tokens[i] = [request.context[-1], *proposed[i]]
        positions[i] = np.arange(n - 1, n + k)
    table = page_table_rows([r.pages for r in requests] + [[]] * (self.batch - len(requests)),
                            self.target.pages_per_seq)
    target_probs = _target_probs(self.target.score(tokens, positions, table), settings)
    accepted, bonus = verify(target_probs, draft_probs, jnp.asarray(proposed), settings,
                             jnp.asarray(np.maximum(positions, 0) + 1))
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

  def _draft(self, requests, drafts, live, starts, settings):
    """k proposals per live row, and the draft's distributions they came from."""
    k, table = self.k, page_table_rows([d.pages for d in drafts] + [[]] * (self.batch - len(drafts)),
                                       self.draft.pages_per_seq)
    # Catch up: feed what the draft's cache lacks (the last token, and the one before it
    # when every proposal was accepted last round), then one token per step.
    tokens = np.zeros((self.batch, 2), np.int32)
    positions = np.full((self.batch, 2), -1, np.int32)
    for i, (draft, n) in enumerate(zip(drafts, starts)):
      if live[i]:
        feed = draft.context[draft.cached:n]
        tokens[i, 2 - len(feed):] = feed
        positions[i, 2 - len(feed):] = np.arange(n - len(feed), n)
    proposed, probs = [], []
    for step in range(k):
      logits = self.draft.score(tokens, positions, table)[:, -1]
      token, q = _propose(logits, settings, jnp.asarray(np.maximum(positions[:, -1], 0) + 1))
      proposed.append(np.asarray(token))
      probs.append(q)
      tokens = proposed[-1][:, None].astype(np.int32)
      positions = np.where(positions[:, -1:] >= 0, positions[:, -1:] + 1, -1).astype(np.int32)
    return np.stack(proposed, axis=1), jnp.stack(probs, axis=1)
