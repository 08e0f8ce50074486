"""A model's own multi-token-prediction module (DeepSeek-V3's MTP) as a draft source.

The module was trained to guess t_{i+2} from the stack's output h_i and the token t_{i+1}
(models/families/deepseek/model.py). Its layer attends over earlier positions, so it keeps
a paged cache of its own (layer group "mtp" of the engine's cache, on the same page
tables; float even over a quantized KV cache, since drafts only propose), entry i written
from the pair (h_i, t_{i+1}):

- a prompt chunk writes its pairs as the stack writes its keys (the token after each is
  known: a chunk stops before the prompt's last token), through this source's fill program;
- a round checks [last token, *proposals]; once the acceptance test has kept `a` of them,
  the pairs of the first a + 1 pass positions are known (each token's successor is the next
  kept one, the last's the round's new token) and written, and the module's output at the
  last of them guesses the token after the new one: the next round's first proposal. With
  k > 1 the module runs on from its own output and guess, as DeepSeek-V3's sequential MTP
  does at deeper depths (entries past the kept ones are rewritten next round, before any
  query reads them).

So every entry a query reads holds the pair of the tokens kept, a round is one compiled
program, and the tokens are the target's own (proposals are deterministic: q one-hot).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.inference.programs import Kind
from jaxpar.inference.sampling import argmax
from jaxpar.inference.speculative import (DETERMINISTIC_TARGET_PROGRAM, OwnPassDraft, apply_masks, check_proposals,
                                         check_round)

GROUP = "mtp"  # the module's layer group in the engine's cache


def _mtp_fill(graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, following):
  """A prompt chunk into the stack's cache and its pairs (each token's output, the token
  after it: `following` [B, T]) into the module's."""
  model = nnx.merge(graphdef, params, model_state)
  x, cache = model.decode_stack(tokens, positions, cache, page_table, kv, rows)
  _, pages = model.mtp_decode(x, following, positions, cache[GROUP], page_table)
  return {**cache, GROUP: pages}


def _mtp_round(k, context, graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings,
               proposed, limit, bitmask=None):
  """The target's pass over [last token, *proposed] with the acceptance test, the kept pairs
  into the module's cache, and its k guesses after the round's new token -> (accepted [B],
  the new token [B], next proposals [B, k], cache). `context`: the engine's max_seq_len."""
  model = nnx.merge(graphdef, params, model_state)
  x, cache = model.decode_stack(tokens, positions, cache, page_table, kv, rows)
  accepted, token = check_proposals(apply_masks(model.logits(model.final_norm(x)), bitmask), None, proposed,
                                    settings, jnp.maximum(positions, 0) + 1, limit)
  along = jnp.arange(tokens.shape[1])[None]
  following = jnp.where(along < accepted[:, None], jnp.roll(tokens, -1, axis=1), token[:, None])
  h, pages = model.mtp_decode(x, following, jnp.where(along <= accepted[:, None], positions, -1), cache[GROUP],
                              page_table)
  batch = jnp.arange(tokens.shape[0])
  h, position = h[batch, accepted], positions[batch, accepted]
  guesses = []
  for depth in range(k):
    guesses.append(argmax(model.mtp_logits(h).astype(jnp.float32)))
    if depth + 1 < k:  # the pair (its own output, its guess), one position on
      position = jnp.where((position >= 0) & (position + 1 < context), position + 1, -1)
      h, pages = model.mtp_decode(h[:, None], guesses[-1][:, None], position[:, None], pages, page_table)
      h = h[:, 0]
  return accepted, token, jnp.stack(guesses, axis=1).astype(jnp.int32), {**cache, GROUP: pages}


FILL_PROGRAM = Kind(_mtp_fill, lambda batch, length, vocab: (jax.ShapeDtypeStruct((batch, length), jnp.int32),))


class MtpDraft(OwnPassDraft):
  """Proposals from the served model's multi-token-prediction module, `k` a round (1: the
  depth it was trained for; more: the module run on from its own guesses)."""
  fill_program = FILL_PROGRAM

  def __init__(self, k: int = 1):
    check_round(k)
    super().__init__()
    self.k = k

  def init_cache(self, model, num_pages, page_size, dtype, slots):
    if getattr(model, "mtp", None) is None:
      raise ConfigError("speculative mtp: the served model has no multi-token-prediction module (a deepseek-family "
                        "model with model.mtp_depth=1 has one): use --speculative ngram or medusa for this model")
    return {GROUP: model.init_mtp_cache(num_pages, page_size, dtype, slots)}

  def bind(self, target):
    check_round(self.k, target)
    if self.k >= target.max_seq_len:
      raise ConfigError(f"speculative mtp k={self.k}: more proposals than the context of {target.max_seq_len} "
                        "holds: use a smaller k")
    self.bind_rows(target)
    self.target_program = Kind(functools.partial(_mtp_round, self.k, target.max_seq_len),
                               DETERMINISTIC_TARGET_PROGRAM.extra, ("rows",) * 3)
