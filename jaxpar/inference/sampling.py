"""Per-request sampling settings and the batched sampler that applies them on device.

Every row of a batch has its own temperature, top-k, top-p and seed. A row's random key is
derived from its request's seed and the position being sampled, so what a request gets
does not depend on which other requests share the batch, or on when it was scheduled.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import Field

from jaxpar.errors import UserError
from jaxpar.models.logprobs import token_logprobs


TOP_LOGPROBS = 20  # most alternatives a request may ask for at each position (as OpenAI's API allows)


class RequestError(UserError):
  """A request setting that cannot work; `field` names it (the HTTP layer answers 400 with it)."""

  def __init__(self, field: str, message: str):
    super().__init__(message)
    self.field = field


@dataclasses.dataclass(frozen=True)
class Bound:
  """The values a request setting may take: [low, high] (None: unbounded; low_open: low
  itself excluded), and what a special value means."""
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  meaning: str = ""

  def holds(self, value) -> bool:
    above = self.low is None or (value > self.low if self.low_open else value >= self.low)
    return above and (self.high is None or value <= self.high)

  def rule(self) -> str:
    if self.high is None:
      text = f"must be {'>' if self.low_open else '>='} {self.low}"
    else:
      text = f"must be in {'(' if self.low_open else '['}{self.low}, {self.high}]"
    return f"{text} ({self.meaning})" if self.meaning else text

  def field(self, default):
    """A pydantic Field with these bounds (the HTTP request models, openai_api.py)."""
    ends = {"gt" if self.low_open else "ge": self.low, "le": self.high}
    return Field(default, **{k: v for k, v in ends.items() if v is not None})


# Every bound on a request's settings, in one place: SamplingParams checks them for the Python
# API and the CLI, and the HTTP request models state them from here (OpenAI's and vLLM's ranges).
BOUNDS = {
  "max_tokens": Bound(0, meaning="0: score the prompt only"),
  "temperature": Bound(0, 2, meaning="0: greedy"),
  "top_k": Bound(-1, meaning="0 or -1: off"),
  "top_p": Bound(0, 1, low_open=True),
  "top_logprobs": Bound(0, TOP_LOGPROBS),
  "prompt_logprobs": Bound(0, TOP_LOGPROBS),
  "min_tokens": Bound(0),
  "presence_penalty": Bound(-2, 2),
  "frequency_penalty": Bound(-2, 2),
  "repetition_penalty": Bound(0, 2, low_open=True, meaning="1: off"),
  "logit_bias": Bound(-100, 100),
  "n": Bound(1, 64),
}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one completion is drawn.

  temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. `stop` strings end
  the text before them; `stop_token_ids` (default: the tokenizer's end of text) end it after
  generating them, but not before `min_tokens` tokens (they are banned until then).
  logprobs: report each token's log-probability under the model (before any of the
  adjustments below); top_logprobs: and that many most likely alternatives;
  prompt_logprobs: also the prompt tokens' (None: not computed; else that many alternatives).
  Adjustments, in the order applied: logit_bias ((token, bias) pairs added to the logits),
  repetition_penalty (divides positive and multiplies negative logits of tokens seen in the
  prompt or output), presence_penalty and frequency_penalty (subtracted once, and once per
  occurrence, for tokens in the output), and `constraint` (a `grammar.Constraint`: only
  tokens it allows). max_tokens 0 computes only the prompt (with prompt_logprobs).
  speculative: take the engine's draft tokens (when it has a draft source); False: one token
  per step, as without one (the row still shares the speculative steps).
  """
  max_tokens: int = 64
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] | None = None
  logprobs: bool = False
  top_logprobs: int = 0
  prompt_logprobs: int | None = None
  min_tokens: int = 0
  logit_bias: tuple[tuple[int, float], ...] = ()
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  constraint: object = None
  speculative: bool = True

  def __post_init__(self):
    for field, bound in BOUNDS.items():
      value = getattr(self, field, None)
      values = [b for _, b in value] if field == "logit_bias" else [] if value is None else [value]
      if not all(bound.holds(v) for v in values):
        raise RequestError(field, f"{field}={value!r} {'values ' if field == 'logit_bias' else ''}{bound.rule()}")
    if self.min_tokens > self.max_tokens:
      raise RequestError("min_tokens", f"min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}")

  @property
  def penalized(self) -> bool:
    return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

  @property
  def processed(self) -> bool:
    """Whether decoding this request needs the step that adjusts logits and reports
    alternatives (`processing.py`); plain requests take the plain step, which costs nothing extra."""
    return bool(self.logit_bias or self.penalized or self.top_logprobs or self.min_tokens
                or self.constraint is not None)


GREEDY = SamplingParams()


def row_arrays(params: list[SamplingParams | None]) -> dict[str, np.ndarray]:
  """Host arrays of one batch's settings (None rows: idle slots, sampled greedily)."""
  rows = [p or GREEDY for p in params]
  return {"temperature": np.asarray([p.temperature for p in rows], np.float32),
          "top_k": np.asarray([p.top_k for p in rows], np.int32),
          "top_p": np.asarray([p.top_p for p in rows], np.float32),
          "seed": np.asarray([p.seed for p in rows], np.uint32),
          "logprobs": np.asarray([p.logprobs for p in rows], bool)}


_BISECTION_STEPS = 32  # threshold resolution: 2^-32 of the probability range
_CANDIDATES = 256  # filtered rows draw from the most likely tokens when their filters fit in these


def _cutoff(probs, enough):
  """Per row, the largest threshold t with enough(probs >= t) still true, by bisection
  (a full sort of a large vocabulary costs tens of milliseconds on CPU)."""
  low = jnp.zeros(probs.shape[:1], probs.dtype)
  high = jnp.max(probs, axis=-1)

  def halve(_, bounds):
    low, high = bounds
    mid = (low + high) / 2
    ok = enough(probs >= mid[:, None])
    return jnp.where(ok, mid, low), jnp.where(ok, high, mid)
  return jax.lax.fori_loop(0, _BISECTION_STEPS, halve, (low, high))[0]


def _filtered_probs(scaled, top_k, top_p):
  """softmax(scaled) restricted to top-k and the top-p nucleus (the most likely tokens whose
  mass first reaches top_p), renormalised; ties at a boundary are all kept."""
  probs = jax.nn.softmax(scaled, axis=-1)
  k = jnp.where(top_k > 0, top_k, scaled.shape[-1])
  by_count = _cutoff(probs, lambda kept: jnp.sum(kept, -1) >= k)
  by_mass = _cutoff(probs, lambda kept: jnp.sum(jnp.where(kept, probs, 0), -1) >= top_p)
  kept = jnp.where(probs >= jnp.maximum(by_count, by_mass)[:, None], probs, 0.0)
  return kept / jnp.sum(kept, -1, keepdims=True)


def _inverse_cdf(probs, uniform):
  """Index drawn from each row of (unnormalised) probs with one uniform number per row."""
  cdf = jnp.cumsum(probs, axis=-1)
  index = jnp.sum(cdf <= uniform[:, None] * cdf[:, -1:], axis=-1)
  return jnp.minimum(index, probs.shape[-1] - 1)


def _draw(logits, settings, uniform):
  """Sampled tokens: unfiltered rows from the whole vocabulary; filtered rows from their
  most likely candidates (one top-k, no sort of the vocabulary), or, when a row's nucleus
  reaches past them, from the exact filter over the whole vocabulary."""
  temperature, top_k, top_p = settings["temperature"], settings["top_k"], settings["top_p"]
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  filtered = (top_k > 0) | (top_p < 1)
  count = min(_CANDIDATES, logits.shape[-1])
  values, indices = jax.lax.top_k(scaled, count)
  p_top = jnp.exp(values - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
  rank = jnp.arange(count)
  keep = (rank < jnp.where(top_k > 0, top_k, count)[:, None]) & (jnp.cumsum(p_top, -1) - p_top < top_p[:, None])
  from_top = jnp.take_along_axis(indices, _inverse_cdf(jnp.where(keep, p_top, 0.0), uniform)[:, None], -1)[:, 0]
  fits = ((top_k > 0) & (top_k <= count)) | (jnp.sum(p_top, -1) >= top_p)
  whole = jax.lax.cond(jnp.any(filtered & ~fits),
                       lambda: _inverse_cdf(_filtered_probs(scaled, top_k, top_p), uniform),
                       lambda: _inverse_cdf(jax.nn.softmax(scaled, axis=-1), uniform))
  return jnp.where(filtered & fits, from_top, whole)


_ARGMAX_BLOCK = 128


def _first_largest(x):
  """Index of each row's first largest entry (the row's length where none equals its max: a
  NaN max): a max and then a min over the row, which XLA vectorises on CPU (its argmax and
  top_k(1) loop, 2-4x slower)."""
  n = x.shape[-1]
  return jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def argmax(logits):
  """Each row's first largest logit [B]. A row holding NaN gets some index in range: which
  one depends on how the backend's max treats NaN (XLA's CPU reductions skip it).

  One pass over the logits takes the largest of each block of 128; the index search then
  runs over the block maxima and the one block that holds the row's first largest. On CPU,
  over [32, 32000] logits, 0.09 against 0.75 ms for the same search over the whole row
  (which reads the logits twice, the second time into an integer min that XLA's CPU
  backend does not vectorise)."""
  batch, vocab = logits.shape
  padded = jnp.pad(logits, ((0, 0), (0, -vocab % _ARGMAX_BLOCK)), constant_values=-jnp.inf)
  blocks = padded.reshape(batch, -1, _ARGMAX_BLOCK)
  # The barrier keeps XLA from fusing the block maxima into both of their uses, which read
  # every logit twice (0.17 against 0.09 ms).
  block_max = jax.lax.optimization_barrier(jnp.max(blocks, axis=-1))
  block = jnp.minimum(_first_largest(block_max), blocks.shape[1] - 1)
  within = _first_largest(jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0])
  return jnp.minimum(block * _ARGMAX_BLOCK + within, vocab - 1)  # past the end only with NaN


def filtered_probs(logits, settings: dict):
  """The distribution each row samples from [B, V]: temperature, top-k and top-p applied;
  one-hot on the argmax for greedy rows."""
  logits = logits.astype(jnp.float32)
  temperature, top_k, top_p = settings["temperature"], settings["top_k"], settings["top_p"]
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  sampled = temperature > 0
  # The filters' bisections cost more than the model on small ones: run them only when a row needs them.
  probs = jax.lax.cond(jnp.any(sampled & ((top_k > 0) | (top_p < 1))),
                       lambda: _filtered_probs(scaled, top_k, top_p),
                       lambda: jax.nn.softmax(scaled, axis=-1))
  greedy = jax.nn.one_hot(argmax(logits), logits.shape[-1])
  return jnp.where(sampled[:, None], probs, greedy)


def row_keys(settings: dict, positions, stream: int = 0):
  """One key per row from its seed, the position sampled and a stream number (so separate
  draws at one position, e.g. speculative decoding's proposal and acceptance, differ)."""
  def key(seed, position):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), stream)
  return jax.vmap(key)(settings["seed"], positions)


def sample(logits, settings: dict, positions):
  """logits [B, V] -> (tokens [B] int32, log-probabilities [B] under the model's distribution).

  settings: `row_arrays` as device arrays; positions [B]: the position each token will
  take, which with the row's seed picks its random key. The log-probabilities are computed
  only when some row asks for them (NaN otherwise): their log-sum-exp over the vocabulary
  cost 2-3% of a batch-32 bench-20m decode step on CPU, for a number most requests drop.
  """
  logits = logits.astype(jnp.float32)
  greedy = argmax(logits)

  def draw(logits):
    uniform = jax.vmap(jax.random.uniform)(row_keys(settings, positions))
    return jnp.where(settings["temperature"] > 0, _draw(logits, settings, uniform), greedy)
  tokens = jax.lax.cond(jnp.any(settings["temperature"] > 0), draw, lambda _: greedy, logits)
  tokens = tokens.astype(jnp.int32)

  return tokens, jax.lax.cond(jnp.any(settings["logprobs"]), lambda: token_logprobs(logits, tokens),
                              lambda: jnp.full(tokens.shape, jnp.nan, jnp.float32))
