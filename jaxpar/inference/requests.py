"""One generation request: its tokens, its place in the KV cache, and the text it streams."""

import dataclasses
import itertools
import time

from jaxpar.inference.draft_length import RowRate
from jaxpar.inference.sampling import RequestError, SamplingParams

_ids = itertools.count()


@dataclasses.dataclass
class Completion:
  """A finished request. finish_reason: "stop" (a stop token or string, or the constraint
  complete), "length" (max_tokens or the context limit) or "cancelled". logprobs: each
  token's; top_logprobs: each token's most likely alternatives [(token, logprob)];
  prompt_logprobs / prompt_top_logprobs: the same for the prompt (None at position 0).
  draft_proposed / draft_accepted: speculative decoding's draft tokens for it, and those kept.
  stop_token: (token, logprob) of the stop token that ended it (not in `tokens`; the logprob
  NaN unless asked for), which reinforcement learning trains on as a sampled token."""
  prompt_tokens: list[int]
  tokens: list[int]
  text: str
  finish_reason: str
  logprobs: list[float] | None = None
  top_logprobs: list[list[tuple[int, float]]] | None = None
  prompt_logprobs: list[float | None] | None = None
  prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
  draft_proposed: int = 0
  draft_accepted: int = 0
  stop_token: tuple[int, float] | None = None


@dataclasses.dataclass
class TokenEvent:
  """One step's news for a request: the token generated, the text it completed (may be
  empty while a UTF-8 character or a possible stop string is still open), and
  `finish_reason` once it is done."""
  request_id: int
  token: int | None
  text: str
  logprob: float | None
  finish_reason: str | None = None
  top_logprobs: list[tuple[int, float]] | None = None


def check_tokens(prompt: list[int], sampling: SamplingParams, stops, vocab: int, max_seq_len: int):
  """A RequestError naming the field when a prompt, its stop tokens or its logit bias cannot
  be generated from: empty, too long for the context, or ids outside the vocabulary."""
  if not prompt:
    raise RequestError("prompt", "the prompt is empty: give at least one token")
  if len(prompt) >= max_seq_len:
    raise RequestError("prompt", f"the prompt has {len(prompt)} tokens but the context holds "
                       f"{max_seq_len}: shorten the prompt or raise max_seq_len")
  if max(prompt) >= vocab or min(prompt) < 0:
    raise RequestError("prompt", f"prompt token ids must be in [0, {vocab}): got {min(prompt)}..{max(prompt)}")
  for field, tokens in (("stop_token_ids", stops), ("logit_bias", [t for t, _ in sampling.logit_bias])):
    if any(not 0 <= t < vocab for t in tokens):
      raise RequestError(field, f"{field}: token ids must be in [0, {vocab})")


def completion_room(prompt_len: int, requested: int | None, limit: int) -> int:
  """The tokens a completion gets: `requested` (None: all the context has left). One rule for
  `jaxpar generate` and `jaxpar serve` (which answers 400, as OpenAI's API does): a prompt
  that leaves no room, or a request for more than there is, is a RequestError, never cut."""
  room = limit - prompt_len
  if room < 1:
    raise RequestError("prompt", f"this model's maximum context length is {limit} tokens, but the prompt has "
                       f"{prompt_len}: shorten it")
  if requested is not None and requested > room:
    raise RequestError("max_tokens", f"max_tokens={requested} is out of range: this model's maximum context "
                       f"length is {limit} tokens and the prompt has {prompt_len}, so use at most {room}")
  return room if requested is None else requested


class IncrementalText:
  """The text of a growing token list, decoding only its newest tokens each time: decoding
  all of them at every step costs O(length) per token (about 1 ms per row and step at 2,048
  tokens with an 8,000-piece BPE tokenizer on a CPU core: more than a small model's step). The tokens from `start` to `read` decoded to complete text
  before; decoding from `start` again and keeping what follows that text gives the new
  text with the same leading-space and byte-fallback handling as decoding everything."""

  def __init__(self):
    self.stable, self.start, self.read = "", 0, 0

  def __call__(self, tokens: list[int], decode) -> str:
    before, now = decode(tokens[self.start:self.read]), decode(tokens[self.start:])
    if not now.startswith(before):  # a decoder that rewrites earlier text: decode it all
      return decode(tokens)
    tail = now[len(before):]
    text = self.stable + tail
    # Complete text: later tokens cannot change it. A token with no text (a skipped special)
    # never starts a window: a decoder that strips the leading space would then strip it.
    if tail and not tail.endswith("\ufffd"):
      self.stable, self.start, self.read = text, self.read, len(tokens)
    return text


class Request:
  """A prompt in flight. `context` is the prompt plus what was generated; `cached` how many
  of its tokens have their keys and values in the cache (after a preemption, 0 again).

  Prefill chunks fill the cache with all of the context but its last token; a decode step
  then feeds that token and samples the next, so a request is ready to decode exactly when
  `cached == len(context) - 1`, whether it is new, growing, or recomputed after preemption.
  """

  def __init__(self, prompt: list[int], sampling: SamplingParams, stop_token_ids: tuple[int, ...],
               on_event=None):
    self.id = next(_ids)
    self.prompt = list(prompt)
    self.sampling = sampling
    self.stop_token_ids = set(stop_token_ids)
    self.on_event = on_event
    self.generated: list[int] = []
    self.logprobs: list[float] = []
    self.top_logprobs: list[list[tuple[int, float]]] = []
    self.stop_token: tuple[int, float] | None = None
    self.matcher = None if sampling.constraint is None else sampling.constraint.matcher()
    wanted = sampling.prompt_logprobs is not None
    self.prompt_logprobs: list[float | None] | None = [None] * len(self.prompt) if wanted else None
    self.prompt_top_logprobs: list | None = [None] * len(self.prompt) if wanted else None
    self.pages: list[int] = []
    self.cached = 0
    # Prefix caching (prefix_cache.py): the hashes of its complete blocks, how many of its
    # pages are indexed, whether this admission looked itself up, the prompt tokens it reused.
    self.block_hashes: list[bytes] = []
    self.published = 0
    self.looked_up = False
    self.prefix_hits = 0
    self.text = ""  # the text streamed so far
    self.generated_text = IncrementalText()
    self.finish_reason: str | None = None
    self.cancelled = False
    self.arrival = time.monotonic()
    self.row = 0  # its row when it runs outside an engine's slots (a speculative draft's copy)
    # Speculative decoding: draft tokens proposed for it, kept, and the target passes it took.
    self.proposed = self.accepted = self.rounds = 0
    self.draft_rate = RowRate()  # how far its drafts are kept (draft_length.py)
    self.adapter = 0  # its stacked LoRA adapter (0: the base; Engine.adapters)
    self.moved = None  # its prompt's KV pages on their way from a prefill engine (disaggregated.py)

  @property
  def context(self) -> list[int]:
    return self.prompt + self.generated

  @property
  def length(self) -> int:
    """len(context), without building it (the decode loop asks every step for every row)."""
    return len(self.prompt) + len(self.generated)

  @property
  def last_token(self) -> int:
    return self.generated[-1] if self.generated else self.prompt[-1]

  @property
  def prefilling(self) -> bool:
    return self.cached < self.length - 1

  def completion(self) -> Completion:
    sampling = self.sampling
    return Completion(self.prompt, list(self.generated), self.text, self.finish_reason,
                      list(self.logprobs) if sampling.logprobs else None,
                      list(self.top_logprobs) if sampling.logprobs and sampling.top_logprobs else None,
                      self.prompt_logprobs, self.prompt_top_logprobs, self.proposed, self.accepted,
                      self.stop_token)

  def record_prompt_logprob(self, position: int, logprob: float, top: list[tuple[int, float]]):
    """The prompt token at `position` (>= 1) scored by the prefill (`processing.FILL_LOGPROBS`)."""
    self.prompt_logprobs[position] = logprob
    self.prompt_top_logprobs[position] = top[:self.sampling.prompt_logprobs]

  def accept(self, token: int, logprob: float, decode, limit: int, top=None) -> TokenEvent:
    """Record a sampled token; decide whether the request is done; say what text it adds.

    decode: token ids -> text. limit: the longest context the cache can hold. top: the most
    likely alternatives [(token, logprob)], when the step reported them.
    """
    sampling = self.sampling
    top = top[:sampling.top_logprobs] if top is not None and sampling.top_logprobs else None
    self.generated.append(token)
    self.logprobs.append(logprob)
    self.top_logprobs.append(top)
    constraint_done = self.matcher is not None and self.matcher.advance(token)
    early = len(self.generated) <= sampling.min_tokens  # no stop string ends it yet
    stop_strings = () if early else sampling.stop
    if token in self.stop_token_ids:
      self.stop_token = (token, logprob)
      self.generated.pop()  # the stop token itself is not part of the completion
      self.logprobs.pop()
      self.top_logprobs.pop()
      self.finish_reason = "stop"
    full = self.generated_text(self.generated, decode)
    if self.finish_reason is None:
      # Only new text can stop it: what was streamed (text from before min_tokens included) stays.
      cut = min((i for i in (full.find(s, len(self.text)) for s in stop_strings) if i >= 0), default=-1)
      if cut >= 0:
        full, self.finish_reason = full[:cut], "stop"
      elif constraint_done:
        self.finish_reason = "stop"
      elif len(self.generated) >= sampling.max_tokens or self.length >= limit:
        self.finish_reason = "length"
    if self.finish_reason is None:
      full = _safe_prefix(full, sampling.stop)
    delta = full[len(self.text):] if full.startswith(self.text) else ""
    self.text += delta
    return TokenEvent(self.id, token, delta, logprob if sampling.logprobs else None, self.finish_reason, top)


def _safe_prefix(text: str, stop_strings) -> str:
  """What may be streamed now: not a trailing replacement character (a UTF-8 sequence still
  being completed) nor a tail that could begin a stop string."""
  end = len(text)
  while end and text[end - 1] == "\ufffd":
    end -= 1
  for stop in stop_strings:
    for k in range(min(len(stop) - 1, end), 0, -1):
      if text[:end].endswith(stop[:k]):
        end -= k
        break
  return text[:end]
