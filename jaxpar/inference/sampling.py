"""Per-request sampling settings and the batched sampler that applies them on device.

Every row of a batch has its own temperature, top-k, top-p and seed. A row's random key is
derived from its request's seed and the position being sampled, so what a request gets
does not depend on which other requests share the batch, or on when it was scheduled.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 is greedy; top_k 0 and top_p 1 switch those filters off. `stop`
  strings end the text before them; `stop_token_ids` (default: the tokenizer's end of
  text) end it after generating them. `logprobs`: report each token's log-probability."""
  max_tokens: int = 64
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] | None = None
  logprobs: bool = False

  def __post_init__(self):
    checks = ((self.max_tokens >= 1, f"max_tokens={self.max_tokens} must be >= 1"),
              (self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0: greedy)"),
              (self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0: off)"),
              (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]"))
    for ok, message in checks:
      if not ok:
        raise ValueError(message)


GREEDY = SamplingParams()


def row_arrays(params: list[SamplingParams | None]) -> dict[str, np.ndarray]:
  """Host arrays of one batch's settings (None rows: idle slots, sampled greedily)."""
  rows = [p or GREEDY for p in params]
  return {"temperature": np.asarray([p.temperature for p in rows], np.float32),
          "top_k": np.asarray([p.top_k for p in rows], np.int32),
          "top_p": np.asarray([p.top_p for p in rows], np.float32),
          "seed": np.asarray([p.seed for p in rows], np.uint32)}


def _filtered_logits(logits, temperature, top_k, top_p):
  """Temperature-scaled logits with everything outside top-k / the top-p nucleus at -inf."""
  scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
  ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
  vocab = logits.shape[-1]
  kth = jnp.take_along_axis(ordered, (jnp.where(top_k > 0, top_k, vocab) - 1)[:, None], axis=-1)
  probs = jax.nn.softmax(ordered, axis=-1)
  # The nucleus: the smallest prefix of the sorted tokens whose probability reaches top_p
  # (a token is kept when the mass before it is still below top_p; the first always is).
  before = jnp.cumsum(probs, axis=-1) - probs
  cutoff = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
  return jnp.where((scaled >= kth) & (scaled >= cutoff), scaled, -jnp.inf)


def filtered_probs(logits, settings: dict):
  """The distribution each row samples from [B, V]: temperature, top-k and top-p applied;
  one-hot on the argmax for greedy rows."""
  logits = logits.astype(jnp.float32)
  filtered = _filtered_logits(logits, settings["temperature"], settings["top_k"], settings["top_p"])
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1])
  return jnp.where((settings["temperature"] > 0)[:, None], jax.nn.softmax(filtered, axis=-1), greedy)


def row_keys(settings: dict, positions, stream: int = 0):
  """One key per row from its seed, the position sampled and a stream number (so separate
  draws at one position, e.g. speculative decoding's proposal and acceptance, differ)."""
  def key(seed, position):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), stream)
  return jax.vmap(key)(settings["seed"], positions)


def sample(logits, settings: dict, positions):
  """logits [B, V] -> (tokens [B] int32, log-probabilities [B] under the model's distribution).

  settings: `row_arrays` as device arrays; positions [B]: the position each token will
  take, which with the row's seed picks its random key.
  """
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1)
  keys = row_keys(settings, positions)
  filtered = _filtered_logits(logits, settings["temperature"], settings["top_k"], settings["top_p"])
  drawn = jax.vmap(jax.random.categorical)(keys, filtered)
  tokens = jnp.where(settings["temperature"] > 0, drawn, greedy).astype(jnp.int32)
  logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
  return tokens, logprobs
