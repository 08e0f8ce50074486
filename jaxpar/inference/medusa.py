"""Medusa heads as a draft source: the served model's own heads (models/medusa.py) propose.

The target's pass that checks a row's proposals also gives the next round's: after the
acceptance test, each head reads the final hidden state at the last position kept (the one
whose output-projection guess is the round's new token) and proposes its best guess for the
token i + 1 after that one. So a round is one compiled program and no host work beyond
reading its outputs; a row's first round after its prompt has no proposals yet and decodes
one token, as plain decoding does. Proposals are deterministic (q one-hot), so sampled rows
keep the target's distribution (speculative.verify). With a tree (draft_tree.py) the heads'
top guesses fill a candidate tree instead of a chain, checked in the same one pass.

The heads come with the model (a run trained with `train.objective: medusa`, which loads its
base from model.medusa.base) or are attached to a served base (`with_heads`). Either way the
heads' saved fingerprint of the base they were trained over must match the base served.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.inference.draft_tree import DraftTree, choose_tree, default_accuracy, verify_tree
from jaxpar.inference.programs import Kind
from jaxpar.inference.speculative import (DETERMINISTIC_TARGET_PROGRAM, OwnPassDraft, apply_masks, check_proposals,
                                         check_round)
from jaxpar.models.caches import copy_positions
from jaxpar.models.medusa import fingerprint, same_fingerprint
from jaxpar.runtime import Runtime
from jaxpar.weights import SavedRun, join, same_network, split_weights


def _medusa_round(k, graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings,
                  proposed, limit, bitmask=None):
  """The target's pass over [last token, *proposed] with the acceptance test, then the heads'
  next proposals -> (accepted [B], the token after them [B], next proposals [B, k], cache)."""
  model = nnx.merge(graphdef, params, model_state)
  hidden, cache = model.decode_hidden(tokens, positions, cache, page_table, kv, rows)
  accepted, token = check_proposals(apply_masks(model.logits(hidden), bitmask), None, proposed, settings,
                                    jnp.maximum(positions, 0) + 1, limit)
  last_kept = jnp.take_along_axis(hidden, accepted[:, None, None], axis=1)[:, 0]
  heads = model.medusa.logits(last_kept, model.output_projection())[:, :k]  # [B, k, V]
  return accepted, token, jnp.argmax(heads, axis=-1).astype(jnp.int32), cache


def _tree_round(tree, graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings,
                proposed, limit, bitmask=None):
  """The target's pass over [last token, *tree nodes] (positions: their cache slots), the
  tree's acceptance test, the kept nodes' keys and values moved right after the root, then
  the heads' next tree -> (accepted [B], the token after them [B], the kept tokens [B,
  depth], the next tree's tokens [B, nodes], cache)."""
  del proposed  # the nodes' tokens are tokens[:, 1:]
  model = nnx.merge(graphdef, params, model_state)
  root = positions[:, :1]
  along = jnp.where(root >= 0, root + jnp.asarray(tree.depths)[None], -1)  # each node's place in its sequence
  hidden, cache = model.decode_hidden(tokens, positions, cache, page_table, kv, rows, tree=tree.mask,
                                      rope_positions=along)
  accepted, path, token = verify_tree(tree, apply_masks(model.logits(hidden), bitmask), tokens, settings, root[:, 0],
                                      limit)
  kept = (jnp.arange(tree.depth)[None] < accepted[:, None]) & (root >= 0)
  cache = copy_positions(cache, page_table, jnp.where(kept, root + path, -1),
                         jnp.where(kept, root + 1 + jnp.arange(tree.depth)[None], -1))
  last = jnp.take_along_axis(path, jnp.maximum(accepted - 1, 0)[:, None], axis=1)[:, 0]
  last_kept = hidden[jnp.arange(hidden.shape[0]), jnp.where(accepted > 0, last, 0)]
  guesses = jax.lax.top_k(model.medusa.logits(last_kept, model.output_projection()), tree.top_k)[1]  # [B, heads, k]
  head, rank = tree.node_guesses()
  return (accepted, token, jnp.take_along_axis(tokens, path, axis=1), guesses[:, head, rank].astype(jnp.int32),
          cache)


def _medusa_program(k: int, tree: DraftTree | None) -> Kind:
  body = functools.partial(_medusa_round, k) if tree is None else functools.partial(_tree_round, tree)
  return Kind(body, DETERMINISTIC_TARGET_PROGRAM.extra, ("rows",) * (3 if tree is None else 4))


class MedusaDraft(OwnPassDraft):
  """Proposals from the served model's Medusa heads: a chain of up to `k` a round (default:
  one per head), each head's best guess, or with `tree` (a DraftTree, or a node count for
  `choose_tree` under `default_accuracy`) every node of a candidate tree."""

  def __init__(self, k: int | None = None, tree: DraftTree | int | None = None):
    if k is not None:
      check_round(k)
    if k is not None and tree is not None:
      raise ConfigError("speculative medusa: give k (a chain) or tree (its node count), not both")
    super().__init__()
    self.k, self.tree = k, tree

  def bind(self, target):
    cfg = target.runtime.model_config
    if cfg.medusa is None:
      raise ConfigError("speculative medusa: the served model has no draft heads: serve a run trained with "
                        "train.objective=medusa, or attach one with --speculative medusa=HEADS_RUN")
    heads = cfg.medusa.heads
    if isinstance(self.tree, int):
      self.tree = choose_tree(default_accuracy(heads), self.tree)
    if self.tree is not None:
      if self.tree.depth > heads:
        raise ConfigError(f"speculative medusa tree: {self.tree.depth} deep, but the model has {heads} draft heads "
                          f"(one per depth): use a tree at most {heads} deep")
      self.k = self.tree.nodes
      if target.cache_bytes["states"]:
        raise ConfigError("speculative medusa tree: the model's linear-attention states would run through "
                          "every candidate in turn: give k (a chain)")
      if target.kv_quantization is not None:
        raise ConfigError(f"speculative medusa tree over a {target.kv_quantization.mode} KV cache: its candidates "
                          "fill slots past a row's page, which a quantized cache would quantize before the check "
                          "keeps them: give k (a chain), or serve with --kv-cache float")
      if target.local_window is not None:
        raise ConfigError("speculative medusa tree: candidates are written past a row's end and moved after the "
                          "check, which sliding-window rings do not do: give k (a chain) instead of a tree")
      if target.max_seq_len <= self.k + 1:
        raise ConfigError(f"speculative medusa tree: {self.k} nodes do not fit the context of "
                          f"{target.max_seq_len}: use fewer nodes or a longer context")
    self.k = self.k or heads
    if self.tree is None and self.k > heads:
      raise ConfigError(f"speculative medusa k={self.k}: the model has {heads} draft heads, one "
                        f"proposal each: use k <= {heads}")
    check_round(self.k, target)
    check_base(target.runtime, target.params, target.model_state)
    self.bind_rows(target)
    self.adaptive = self.chain = self.tree is None  # a tree's nodes are checked together: its pass is one shape
    self.target_program = _medusa_program(self.k, self.tree)

  def kept(self, proposed, outputs):
    return (outputs[0], outputs[1:]) if self.tree is not None else (proposed, outputs)


def check_base(runtime, params, model_state):
  """Refuse heads trained over other weights than `params`' base: their saved fingerprint
  (written by the first training step) must match the base's."""
  saved = np.asarray(model_state["medusa"]["base_fingerprint"])
  if not saved.any():
    raise ConfigError("speculative medusa: these draft heads were never trained (they hold no fingerprint of "
                      "a base): train them with train.objective=medusa")
  with runtime.context():
    served = jax.jit(fingerprint)(split_weights(runtime, params)[1])
  if not same_fingerprint(saved, served):
    raise ConfigError("speculative medusa: the draft heads were trained over another base than the model "
                      "served (their saved fingerprint differs): serve the base they were trained over "
                      "(its model.medusa.base), or train heads for this one")


def with_heads(run, heads_path) -> tuple:
  """(runtime, params, model_state) of a loaded saved run with the draft heads of the run at
  `heads_path` (trained with train.objective=medusa over the same network) attached."""
  with SavedRun(heads_path) as heads:
    ours, theirs = run.config.model, heads.config.model
    if theirs.medusa is None:
      raise ConfigError(f"--speculative medusa={heads_path}: that run has no draft heads: give a run trained "
                        "with train.objective=medusa")
    if not same_network(ours, theirs):
      raise ConfigError(f"--speculative medusa={heads_path}: its heads belong to another model section than "
                        f"{run.directory}'s: serve them over the base they were trained for")
    model = ours.model_copy(update={"medusa": theirs.medusa.model_copy(update={"base": None})})
    runtime = Runtime(model, run.runtime.mesh_config, run.runtime.mesh.devices.flat, seed=run.config.train.seed,
                      parallel=run.config.parallel)
    params = join(heads.read_adapters(runtime), run.params)
    stamp = heads.read_model_state(runtime)["medusa"]  # the base's own state stays the served run's
  return runtime, params, {**run.model_state, "medusa": stamp}
