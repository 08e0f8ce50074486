"""Per-request logits adjustments and log-probability reports: the two extra programs that
carry them, and the host arrays that feed them.

The plain decode step (`programs.py`) samples from the model's logits as they are. When a
row in the batch asks for more (logit_bias, penalties, a grammar, min_tokens, top
alternatives), the engine runs `step_processed` instead: the same model call, then each
row's adjustments, then the same sampler, and the most likely alternatives under the raw
distribution. Rows that ask for nothing get neutral values (zero bias, all tokens allowed),
so they draw exactly what the plain step would give them; a batch that asks for nothing
never runs it. `fill_logprobs` is the prefill chunk that also scores each prompt token.

Adjustments follow vLLM's order: bias, then repetition penalty (on the biased logits), then
presence and frequency penalties, then the token mask (grammar and min_tokens bans).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.inference.programs import Kind, settings_struct
from jaxpar.inference.sampling import TOP_LOGPROBS, sample

MAX_LOGIT_BIAS = 300  # entries a request's logit_bias may hold (a fixed width on the device)


def mask_words(vocab: int) -> int:
  """int32 words of a token bitmask (bit t % 32 of word t // 32: token t allowed)."""
  return -(-vocab // 32)


def extras_struct(batch: int, vocab: int, history: int) -> dict:
  s = jax.ShapeDtypeStruct
  return {"bias_ids": s((batch, MAX_LOGIT_BIAS), jnp.int32), "bias": s((batch, MAX_LOGIT_BIAS), jnp.float32),
          "history": s((batch, history), jnp.int32), "prompt_len": s((batch,), jnp.int32),
          "presence": s((batch,), jnp.float32), "frequency": s((batch,), jnp.float32),
          "repetition": s((batch,), jnp.float32), "bitmask": s((batch, mask_words(vocab)), jnp.int32)}


def allowed(bitmask, vocab: int):
  """[B, W] int32 bitmask -> [B, vocab] bool."""
  token = jnp.arange(vocab)
  return ((bitmask[:, token // 32] >> (token % 32)) & 1).astype(bool)


def adjust(logits, extras):
  """Each row's adjustments applied to logits [B, V] f32 (see the module doc)."""
  batch, vocab = logits.shape
  rows = jnp.arange(batch)[:, None]
  logits = logits.at[rows, extras["bias_ids"]].add(extras["bias"], mode="drop")

  def penalize(logits):
    history = extras["history"]  # context tokens, padded with `vocab` (dropped by the scatters)
    in_output = jnp.arange(history.shape[1])[None, :] >= extras["prompt_len"][:, None]
    counts = jnp.zeros_like(logits).at[rows, history].add(in_output.astype(logits.dtype), mode="drop")
    seen = jnp.zeros(logits.shape, bool).at[rows, history].set(True, mode="drop")
    repetition = extras["repetition"][:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - extras["presence"][:, None] * (counts > 0) - extras["frequency"][:, None] * counts
  penalized = (extras["repetition"] != 1) | (extras["presence"] != 0) | (extras["frequency"] != 0)
  logits = jax.lax.cond(jnp.any(penalized), penalize, lambda x: x, logits)
  return jnp.where(allowed(extras["bitmask"], vocab), logits, -jnp.inf)


def _step_processed(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings,
                    extras):
  model = nnx.merge(graphdef, params, model_state)
  first = jnp.zeros(tokens.shape[:1], jnp.int32)
  logits, cache = model.decode(tokens, positions, cache, page_table, logits_index=first,
                               kv_quantization=kv, tail_index=rows)
  logits = logits.astype(jnp.float32)
  next_tokens, _ = sample(adjust(logits, extras), settings, positions[:, 0] + 1)
  logprobs = jax.nn.log_softmax(logits, axis=-1)
  top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
  chosen = jnp.take_along_axis(logprobs, next_tokens[:, None], axis=-1)[:, 0]
  return next_tokens, chosen, top_ids.astype(jnp.int32), top_logprobs, cache


def _fill_logprobs(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, targets):
  """A prefill chunk that also returns, at each position, the log-probability of `targets`
  (the next prompt token) and the most likely alternatives."""
  model = nnx.merge(graphdef, params, model_state)
  logits, cache = model.decode(tokens, positions, cache, page_table, kv_quantization=kv, tail_index=rows)
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
  chosen = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
  return chosen, top_ids.astype(jnp.int32), top_logprobs, cache


def step_processed_kind(history: int) -> Kind:
  return Kind(_step_processed,
              lambda batch, _, vocab: (settings_struct(batch), extras_struct(batch, vocab, history)),
              ("rows", "rows", "rows", "rows"))


FILL_LOGPROBS = Kind(_fill_logprobs, lambda batch, length, _: (jax.ShapeDtypeStruct((batch, length), jnp.int32),),
                     ("rows", "rows", "rows"))


def extras_arrays(requests: list, vocab: int, history: int) -> dict[str, np.ndarray]:
  """The host arrays of `extras_struct` for one decode step's rows (None: an idle slot).
  Each request's constraint gives its next-token mask; stop tokens are banned until its
  min_tokens are out."""
  batch = len(requests)
  out = {"bias_ids": np.full((batch, MAX_LOGIT_BIAS), vocab, np.int32),
         "bias": np.zeros((batch, MAX_LOGIT_BIAS), np.float32),
         "history": np.full((batch, history), vocab, np.int32), "prompt_len": np.zeros(batch, np.int32),
         "presence": np.zeros(batch, np.float32), "frequency": np.zeros(batch, np.float32),
         "repetition": np.ones(batch, np.float32), "bitmask": np.full((batch, mask_words(vocab)), -1, np.int32)}
  for i, request in enumerate(requests):
    if request is None:
      continue
    sampling = request.sampling
    if sampling.logit_bias:
      ids, values = zip(*sampling.logit_bias)
      out["bias_ids"][i, :len(ids)], out["bias"][i, :len(ids)] = ids, values
    if sampling.penalized:
      context = request.context
      out["history"][i, :len(context)] = context
      out["prompt_len"][i] = len(request.prompt)
      out["presence"][i], out["frequency"][i] = sampling.presence_penalty, sampling.frequency_penalty
      out["repetition"][i] = sampling.repetition_penalty
    if request.matcher is not None:
      request.matcher.fill_mask(out["bitmask"][i])
    if len(request.generated) < sampling.min_tokens:
      words = out["bitmask"][i].view(np.uint32)
      for token in request.stop_token_ids:
        words[token // 32] &= ~np.uint32(1 << (token % 32))
  return out


def prompt_targets(group: list, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
  """`fill_logprobs`'s targets: at each position of a prefill chunk, the prompt token after it."""
  targets = np.zeros_like(tokens)
  for i, request in enumerate(group):
    count = int(np.sum(positions[i] >= 0))
    targets[i, :count] = request.context[positions[i, 0] + 1:positions[i, 0] + 1 + count]
  return targets


def record_prompt_logprobs(group: list, positions: np.ndarray, chosen, top_ids, top_logprobs):
  """Hand `fill_logprobs`'s outputs to the requests of the chunk that asked for them."""
  chosen, top_ids, top_logprobs = np.asarray(chosen), np.asarray(top_ids), np.asarray(top_logprobs)
  for i, request in enumerate(group):
    for j in range(int(np.sum(positions[i] >= 0)) if request.prompt_logprobs is not None else 0):
      if (position := positions[i, j] + 1) < len(request.prompt):
        request.record_prompt_logprob(position, float(chosen[i, j]),
                                      list(zip(top_ids[i, j].tolist(), top_logprobs[i, j].tolist())))
