"""Speculative decoding (Leviathan et al., 2023; Chen et al., 2023), a mode of the engine: a
draft proposes k tokens for every decoding row, the target checks them in one forward pass,
inside continuous batching (requests come and go between rounds as between decode steps).

Each proposed token x is kept with probability min(1, p(x) / q(x)) (p: target, q: draft,
both after temperature / top-k / top-p); at the first rejection the token is drawn from
max(0, p - q) renormalised, and when all k are kept one more comes from the target's next
distribution. The output then follows the target's distribution exactly; greedy rows (one-
hot p and q) give exactly the target's greedy tokens.

A draft is a source of proposals behind one interface (`DraftSource`): `DraftModel`, a
smaller model on the same tokenizer; `NgramDraft`, prompt lookup with no weights (the tokens
that followed the last earlier occurrence of a row's final n-gram); `medusa.MedusaDraft`, the
model's own Medusa heads, as a chain or a tree (draft_tree.py). Each row gets up to the
round's width of proposals, at most k (draft_length.py chooses it; a row with none decodes
one token, exactly as plain decoding does). A deterministic draft's q
is one-hot at its proposal, so it keeps a proposal with probability p(x) and resamples from p
without x. The draft model keeps its own paged cache: a request's context is prefilled
into it when the request first decodes, then each round feeds what it lacks (the last token,
and the one before it when every proposal was kept) and proposes k. Positions past what was
accepted hold stale keys and values in both caches, never read (attention stops at each
query's position) and overwritten next round. A round is two compiled programs: the draft's
k proposals (a loop on the device), and the target's pass with the acceptance test.
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.inference.draft_length import pass_widths
from jaxpar.inference.pages import page_table_rows
from jaxpar.inference.processing import allowed, mask_words
from jaxpar.inference.programs import Kind, settings_extra, settings_struct
from jaxpar.inference.requests import Request
from jaxpar.inference.sampling import argmax, filtered_probs, row_arrays, row_keys
from jaxpar.models import recurrent_state

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
                  draft_probs, proposed, limit, bitmask=None):
  """The target's pass over [last token, *proposed] and the acceptance test -> (accepted
  count [B], the token after them [B], cache). draft_probs None: a deterministic draft;
  bitmask: each position's allowed tokens (`with_masks`)."""
  logits, cache = nnx.merge(graphdef, params, model_state).decode(tokens, positions, cache, page_table,
                                                                  kv_quantization=kv, tail_index=rows)
  accepted, token = check_proposals(apply_masks(logits, bitmask), draft_probs, proposed, settings,
                                    jnp.maximum(positions, 0) + 1, limit)
  return accepted, token, cache


def apply_masks(logits, bitmask):
  """logits [B, T, V] with the tokens a grammar forbids at each position set to -inf
  (bitmask [B, T, words], processing.allowed's format); None: every token allowed."""
  if bitmask is None:
    return logits
  vocab = logits.shape[-1]
  permitted = jax.vmap(lambda words: allowed(words, vocab), in_axes=1, out_axes=1)(bitmask)
  return jnp.where(permitted, logits, -jnp.inf)


def rolling_back(kind: Kind) -> Kind:
  """A target program (`kind`, whose first output is each row's accepted count) that keeps
  linear-attention layers' states at the last kept token: candidates opened before the
  pass, each row's committed after the acceptance test (models/recurrent_state.py). The
  same program for models without such layers."""
  def body(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, *rest, **masks):
    cache = recurrent_state.open_candidates(cache, tokens.shape[1])
    *outputs, cache = kind.body(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, *rest,
                                **masks)
    return (*outputs, recurrent_state.commit(cache, outputs[0], positions, rows))
  return Kind(body, kind.extra, kind.outputs)


def with_masks(kind: Kind) -> Kind:
  """A target program taking, last, each position's allowed tokens [B, length, words]: the
  rounds of batches with a grammar row (compiled on first use)."""
  def extra(batch, length, vocab):
    return (*kind.extra(batch, length, vocab), jax.ShapeDtypeStruct((batch, length, mask_words(vocab)), jnp.int32))
  return Kind(lambda *args: kind.body(*args[:-1], bitmask=args[-1]), extra, kind.outputs)


def _draft_program(k):
  return Kind(functools.partial(_draft_round, k), settings_extra, (None, None))


def _proposals(batch, length):
  """The proposed tokens [B, k] and how many of each row's are proposals [B]."""
  return (jax.ShapeDtypeStruct((batch, length - 1), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32))


TARGET_PROGRAM = Kind(_target_round, lambda batch, length, vocab: (
    settings_struct(batch), jax.ShapeDtypeStruct((batch, length - 1, vocab), jnp.float32), *_proposals(batch, length)),
    ("rows", "rows"))
# A deterministic draft's (NgramDraft): no distributions to pass, q is one-hot at each proposal.
DETERMINISTIC_TARGET_PROGRAM = Kind(
    lambda graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings, proposed, limit,
    bitmask=None: _target_round(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows,
                                settings, None, proposed, limit, bitmask),
    lambda batch, length, vocab: (settings_struct(batch), *_proposals(batch, length)), ("rows", "rows"))


def check_proposals(logits, draft_probs, proposed, settings, positions, limit):
  """The acceptance test from the target's logits [B, k+1, V] (`verify`'s other arguments):
  `verify` on their filtered distributions or, when every row is greedy, its answer without
  them (a greedy row keeps its proposals while each is the target's argmax, then takes the
  argmax after them), which skips a softmax and a categorical draw over the vocabulary per
  row (0.8 ms of a 5 ms round at bench-20m's 32000 on CPU)."""
  logits = logits.astype(jnp.float32)
  k = proposed.shape[1]

  def greedy():
    best = jax.vmap(argmax, in_axes=1, out_axes=1)(logits)  # [B, k + 1]
    keep = (proposed == best[:, :k]) & (jnp.arange(k)[None] < limit[:, None])
    accepted = jnp.sum(jnp.cumprod(keep, axis=1), axis=1)
    return accepted, jnp.take_along_axis(best, accepted[:, None], axis=1)[:, 0].astype(jnp.int32)

  def sampled():
    target_probs = jax.vmap(filtered_probs, in_axes=(1, None), out_axes=1)(logits, settings)
    return verify(target_probs, draft_probs, proposed, settings, positions, limit)
  return jax.lax.cond(jnp.any(settings["temperature"] > 0), sampled, greedy)


def verify(target_probs, draft_probs, proposed, settings, positions, limit=None):
  """target_probs [B, k+1, V], draft_probs [B, k, V] (None: a deterministic draft, q one-hot at
  each proposal), proposed [B, k] int; positions [B, k+1]: where each checked token would go;
  limit [B]: how many of each row's k are proposals (None: all). -> (accepted count [B], the
  token after them [B])."""
  batch, k = proposed.shape
  limit = jnp.full((batch,), k, jnp.int32) if limit is None else limit
  p_of = jnp.take_along_axis(target_probs[:, :k], proposed[..., None], axis=-1)[..., 0]
  q_of = (jnp.ones_like(p_of) if draft_probs is None
          else jnp.take_along_axis(draft_probs, proposed[..., None], axis=-1)[..., 0])
  keys = jax.vmap(lambda pos: row_keys(settings, pos, _ACCEPT), in_axes=1, out_axes=1)(positions[:, :k])
  uniform = jax.vmap(jax.vmap(jax.random.uniform))(keys)
  keep = (uniform * q_of < p_of) & (jnp.arange(k)[None] < limit[:, None])  # u < p / q, without dividing by a zero q
  accepted = jnp.sum(jnp.cumprod(keep, axis=1), axis=1)
  rows = jnp.arange(batch)
  p_next = target_probs[rows, accepted]
  rejected = (accepted < limit)[:, None]  # else every proposal was kept: the next token comes from p
  if draft_probs is None:
    at = jnp.minimum(accepted, k - 1)
    q_next = jnp.where(rejected, jax.nn.one_hot(proposed[rows, at], p_next.shape[-1], dtype=p_next.dtype), 0.0)
  else:
    q_next = jnp.where(rejected, draft_probs[rows, jnp.minimum(accepted, k - 1)], 0.0)
  residual = jnp.maximum(p_next - q_next, 0.0)
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_next)
  keys = row_keys(settings, positions[rows, accepted], _RESIDUAL)
  token = jax.vmap(lambda key, r: jax.random.categorical(key, jnp.log(r)))(keys, residual)
  return accepted, token.astype(jnp.int32)


def page_room(starts, page_size: int) -> np.ndarray:
  """How many proposals each row's pass can check over a quantized KV cache, whose newest
  page stays float until it fills (models/kv_cache_quantized.py). Plain decoding reads a
  page float for every query inside it but its last slot, and quantized from then on. A
  pass that crossed into the next page, or wrote the last slot, would quantize the page for
  all its queries, and one whose drafts were rejected would leave a later page as the row's
  tail; so a row's pass (its last token, at starts - 1, and its proposals) stays in that
  token's page short of the last slot, and a row whose token is in the last slot decodes it
  alone. Rows with no request (start 0) get what an empty row would."""
  slot = np.maximum(np.asarray(starts) - 1, 0) % page_size
  return np.maximum(page_size - 2 - slot, 0)


def check_round(k: int, *engines):
  """What every draft source needs of the engines a round runs on."""
  if k < 1:
    raise ConfigError(f"speculative k={k}: the draft must propose at least one token")
  for engine in engines:
    if engine.local_window is not None and k + 1 > engine.local_window:
      raise ConfigError(f"speculative k={k}: a round writes k + 1 positions, more than the local layers' window "
                        f"({engine.local_window}) keeps; use k < {engine.local_window}")
    if engine.adapters:
      raise ConfigError("speculative decoding does not serve stacked adapters: merge the adapter "
                        "(`jaxpar lora merge`) and use the merged model as the target")


class DraftSource:
  """What every draft source shares: `k`, the most proposals a row gets a round; `bind(target)`
  checks the pair and compiles what the source needs; `propose(rows, starts, settings)` gives
  (proposals [B, k] host, how many of each row's are proposals [B], their distributions [B,
  k, V] or None for a deterministic source); `target_program` checks them. After a round,
  `kept` says which tokens the accepted counts count (the proposals, in order, unless the
  program says otherwise: a tree's kept path), `receive` gets the program's other outputs
  (a source whose proposals come out of the target's own pass), `advance` each row still
  running, `forget` each row that ended or was preempted. Rows under a grammar keep their
  proposals up to the first it forbids, and the pass masks each position's logits.
  `adaptive`: a round checks as many proposals as draft_length.py chooses from the rows'
  acceptance and the measured cost of each of `widths` (each compiled at start)."""
  target_program = DETERMINISTIC_TARGET_PROGRAM
  fill_program = None  # a prompt-writing program of its own (Kind; given the token after each), if any
  adaptive = True
  chain = True  # proposal j follows proposal j - 1 (a tree's nodes do not)

  def init_cache(self, model, num_pages: int, page_size: int, dtype, slots: int) -> dict:
    """Layer groups of its own that the target's cache keeps beside the model's (none)."""
    return {}

  @property
  def widths(self) -> tuple[int, ...]:
    return pass_widths(self.k) if self.adaptive else (self.k,)

  def kept(self, proposed, outputs: list) -> tuple:
    """(the tokens each row's accepted count counts [B, >= count], the outputs left)."""
    return proposed, outputs

  def receive(self, rows, outputs):
    pass

  def advance(self, request: Request, start: int):
    pass

  def forget(self, request: Request):
    pass


class OwnPassDraft(DraftSource):
  """A source whose proposals come out of the target's own checking pass (Medusa heads, an
  MTP module): each round's program also returns every row's next proposals, made for its
  length after the round, so a round is one compiled program; a row's first round after its
  prompt has none and decodes one token, as plain decoding does."""

  def __init__(self):
    self.pending: dict[int, tuple[int, np.ndarray]] = {}  # request id -> (its length then, proposals)

  def bind_rows(self, target):
    self.batch, self.max_seq_len = len(target.slots), target.max_seq_len

  def propose(self, rows, starts, settings):
    proposed = np.zeros((self.batch, self.k), np.int32)
    limit = np.zeros(self.batch, np.int32)
    for i, request in enumerate(rows):
      length, drafts = self.pending.get(getattr(request, "id", None), (None, None))
      if length is not None and length == request.length:  # proposed for exactly this context
        # Proposals past the context are written nowhere: none of them is a candidate.
        proposed[i], limit[i] = drafts, min(self.k, self.max_seq_len - length)
    return proposed, limit, None

  def receive(self, rows, outputs):
    (drafts,) = outputs
    for i, request in enumerate(rows):
      if request is not None and request.finish_reason is None:
        self.pending[request.id] = (request.length, drafts[i])

  def forget(self, request):
    self.pending.pop(request.id, None)


# Text a draft's tokenizer must split into the target's ids: words, digits, punctuation, accents.
_PROBE = "Speculative drafts check 0123456789 tokens: the same ids? ¿Sí, déjà vu! \n\t(x)"


class DraftModel(DraftSource):
  """Proposals from `engine`, a smaller model on the target's tokenizer, `k` per round. Its
  engine serves only this draft (its cache holds the target's requests by their slot)."""
  target_program = TARGET_PROGRAM

  def __init__(self, engine, k: int = 4):
    check_round(k)
    self.engine, self.k = engine, k
    self.shadows: dict[int, Request] = {}  # target request id -> the draft's copy of it

  def bind(self, target):
    """Check the pair and compile the proposal program for the target's slots."""
    draft, k = self.engine, self.k
    if target.runtime.model_config.vocab_size != draft.runtime.model_config.vocab_size:
      raise ConfigError("the speculative draft and the target must share a vocabulary (and tokenizer)")
    if (draft.tokenizer.encode(_PROBE), draft.tokenizer.eos_id) != (target.tokenizer.encode(_PROBE),
                                                                     target.tokenizer.eos_id):
      raise ConfigError("the speculative draft's tokenizer differs from the target's (it splits the same text "
                        "into other ids): use a draft trained with the target's tokenizer")
    check_round(k, target, draft)
    if draft.cache_bytes["states"]:
      raise ConfigError("the speculative draft has linear-attention layers, whose state its own proposals run "
                        "past: use a draft of attention layers only (the target may have them)")
    if draft.kv_quantization is not None:
      raise ConfigError(f"the speculative draft's KV cache is {draft.kv_quantization.mode}: its proposals run "
                        "past pages it rewrites next round, which a quantized cache does not undo; give the "
                        "draft engine a float cache (only the target's may be quantized)")
    if len(draft.slots) < len(target.slots) or draft.max_seq_len < target.max_seq_len:
      raise ConfigError(f"the draft engine needs the target's {len(target.slots)} slots and context "
                        f"{target.max_seq_len} (it has {len(draft.slots)} and {draft.max_seq_len})")
    self.batch = len(target.slots)
    draft.programs.compile("propose", self.batch, 2, draft.pages_per_seq, _draft_program(k))

  def propose(self, rows, starts, settings):
    """k proposals [B, k] (host) for each row (a target Request or None), how many of each
    row's are proposals [B] (k, or 0 for no request), and the draft's distributions they came
    from [B, k, V] (device); `starts`: where each row's next token goes."""
    draft, k = self.engine, self.k
    tokens = np.zeros((self.batch, 2), np.int32)
    positions = np.full((self.batch, 2), -1, np.int32)
    shadows = []
    for i, (request, n) in enumerate(zip(rows, starts)):
      shadow = None if request is None else self._admit(request, i)
      shadows.append(shadow)
      if shadow is None:
        continue
      # Proposals past the context are never kept (the target's pass writes them nowhere).
      if not draft.pool.grow(shadow.pages, min(n + k, draft.max_seq_len)):
        raise RuntimeError("the draft's KV page pool is too small for speculative decoding: raise its num_pages")
      feed = request.context[shadow.cached:n]  # what the draft's cache lacks
      tokens[i, 2 - len(feed):] = feed
      positions[i, 2 - len(feed):] = np.arange(n - len(feed), n)
    table = page_table_rows([s.pages if s else [] for s in shadows], draft.pages_per_seq, draft.pool.num_pages)
    proposed, probs, draft.cache = draft._run("propose", tokens, positions, table,
                                              np.arange(self.batch, dtype=np.int32), settings)
    limit = np.asarray([0 if shadow is None else k for shadow in shadows], np.int32)
    return np.asarray(proposed), limit, probs

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


def ngram_lookup(tokens, k: int, max_n: int, min_n: int = 1) -> list[int]:
  """Up to k tokens that followed the latest earlier occurrence of the last n tokens of
  `tokens`, for the longest n in [min_n, max_n] that occurs earlier; [] when none does."""
  tokens = np.asarray(tokens)
  for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
    windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # each ends before the last token
    starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    if starts.size:
      return tokens[starts[-1] + n:starts[-1] + n + k].tolist()
  return []


class NgramDraft(DraftSource):
  """Prompt lookup (no second model): each row proposes up to k tokens that followed the
  latest earlier occurrence of its last n tokens (n from max_n down to min_n) in its prompt
  and output so far. Text that repeats itself (code, extraction, quoting the prompt) is
  proposed for free; a row whose tail occurs nowhere earlier proposes nothing that round."""
  target_program = DETERMINISTIC_TARGET_PROGRAM

  def __init__(self, k: int = 4, max_n: int = 3, min_n: int = 1):
    check_round(k)
    if not 1 <= min_n <= max_n:
      raise ConfigError(f"speculative ngram n={min_n}..{max_n}: give 1 <= min_n <= max_n")
    self.k, self.max_n, self.min_n = k, max_n, min_n

  def bind(self, target):
    check_round(self.k, target)
    self.batch = len(target.slots)

  def propose(self, rows, starts, settings):
    """Proposals [B, k] (host; past a row's own count, zeros), how many each row has [B], None
    (no distributions: the target's pass takes q one-hot at each proposal)."""
    proposed = np.zeros((self.batch, self.k), np.int32)
    limit = np.zeros(self.batch, np.int32)
    for i, request in enumerate(rows):
      if request is not None and request.sampling.speculative:  # off: nothing to look up
        found = ngram_lookup(request.context, self.k, self.max_n, self.min_n)
        proposed[i, :len(found)], limit[i] = found, len(found)
    return proposed, limit, None


class SpeculativeCalls:
  """The engine's speculative rounds (`Engine` inherits them; `self.draft` proposes)."""

  def _speculate(self) -> list:
    """One round for every slot ready to decode: pages for k more positions each (the newest
    requests preempted if need be), the draft's proposals, the target's check, the tokens
    kept turned into events."""
    k = self.draft.k
    for request in sorted((r for r in self.slots if r is not None and not r.prefilling), key=lambda r: r.arrival):
      if request in self.slots:  # not preempted by an older request's growth
        # Positions past the context are written nowhere (below): no pages for them.
        self._reserve(request, min(request.length + k, self.max_seq_len))
    rows = [r if r is not None and not r.prefilling else None for r in self.slots]
    starts = [0 if r is None else r.length for r in rows]
    settings = row_arrays([r.sampling if r else None for r in rows])
    proposed, limit, draft_probs = self.draft.propose(rows, starts, settings)
    # A request that turned speculation off keeps none of them: one token a round, as plain decoding.
    off = np.array([r is not None and not r.sampling.speculative for r in rows])
    proposed, limit = np.where(off[:, None], 0, proposed), np.where(off, 0, limit)
    # No more proposals than a row has room for beside the target's own token: none is counted
    # accepted that max_tokens would then drop.
    room = [0 if r is None else max(r.sampling.max_tokens - len(r.generated) - 1, 0) for r in rows]
    limit = np.minimum(limit, room)
    if self.kv_quantization is not None:
      limit = np.minimum(limit, page_room(starts, self.pool.page_size))
    if self.draft.adaptive:  # the width with the most tokens per second, from the rows' rates
      rates = [r.draft_rate.rate() for r, n in zip(rows, limit) if r is not None and n]
      width = self._widths.choose(rates, sum(r is not None for r in rows) - len(rates))
      limit = np.minimum(limit, width)
      proposed = proposed[:, :width]
      draft_probs = None if draft_probs is None else draft_probs[:, :width]
    width = proposed.shape[1]
    limit, masks = self._grammar_masks(rows, proposed, np.array(limit, np.int32))
    tokens = np.zeros((len(rows), width + 1), np.int32)
    positions = np.full((len(rows), width + 1), -1, np.int32)
    for i, (request, n) in enumerate(zip(rows, starts)):
      if request is not None:
        tokens[i] = [request.last_token, *proposed[i]]
        at = np.arange(n - 1, n + width)
        # Past the context, or past the row's own proposals: written nowhere.
        positions[i] = np.where((at < self.max_seq_len) & (at < n + limit[i]), at, -1)
    table = page_table_rows([r.pages if r else [] for r in rows], self.pages_per_seq, self.pool.num_pages)
    given = (proposed, limit) if draft_probs is None else (draft_probs, proposed, limit)
    given += () if masks is None else (masks,)
    started = time.perf_counter()
    accepted, bonus, *more, self.cache = self._run("speculate" if masks is None else "speculate_masked", tokens,
                                                   positions, table, np.arange(len(rows), dtype=np.int32),
                                                   settings, *given)
    accepted, bonus = np.asarray(accepted).tolist(), np.asarray(bonus).tolist()
    if self.draft.adaptive:
      self._widths.record(width, time.perf_counter() - started)
    kept, more = self.draft.kept(proposed, [np.asarray(x) for x in more])
    events = []
    for i, (request, n) in enumerate(zip(rows, starts)):
      if request is None:
        continue
      request.proposed += int(limit[i])
      request.accepted += accepted[i]
      request.rounds += 1
      if limit[i]:
        request.draft_rate.update(int(limit[i]), accepted[i])
      self.stats["speculative_rounds"] += 1
      for token in [*kept[i, :accepted[i]].tolist(), bonus[i]]:
        request.cached = request.length
        self.sharing.publish(request)
        events.append(self._deliver(request, request.accept(token, 0.0, self.tokenizer.decode, self.max_seq_len)))
        if request.finish_reason is not None:
          self._free(request)
          break
      else:
        self.draft.advance(request, n)
    self.draft.receive(rows, more)
    self.stats["speculative_calls"] += 1  # target passes of the whole batch
    self.stats["speculative_proposed"] += int(limit.sum())
    self.stats["speculative_accepted"] += sum(a for a, r in zip(accepted, rows) if r is not None)
    return events

  def _grammar_masks(self, rows, proposed, limit) -> tuple:
    """(limit, masks) for a round: a row under a grammar keeps its proposals up to the first
    the grammar forbids (or none: a tree's nodes do not follow one another), with the tokens
    allowed at each position [B, width + 1, words]; masks None when no row has a grammar."""
    grammar = [i for i, r in enumerate(rows) if r is not None and r.matcher is not None]
    if not grammar:
      return limit, None
    masks = np.full((*proposed.shape[:1], proposed.shape[1] + 1, mask_words(self.runtime.model_config.vocab_size)),
                    -1, np.int32)
    for i in grammar:
      along = proposed[i, :limit[i]] if self.draft.chain else []
      limit[i] = rows[i].matcher.masks_along(along, masks[i])
    return limit, masks
