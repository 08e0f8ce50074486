"""Medusa heads as a draft source: the served model's own heads (models/medusa.py) propose.

The target's pass that checks a row's proposals also gives the next round's: after the
acceptance test, each head reads the final hidden state at the last position kept (the one
whose output-projection guess is the round's new token) and proposes its best guess for the
token i + 1 after that one. So a round is one compiled program and no host work beyond
reading its outputs; a row's first round after its prompt has no proposals yet and decodes
one token, as plain decoding does. Proposals are deterministic (q one-hot), so sampled rows
keep the target's distribution (speculative.verify).

The heads come with the model (a run trained with `train.objective: medusa`, which loads its
base from model.medusa.base) or are attached to a served base (`with_heads`). Either way the
heads' saved fingerprint of the base they were trained over must match the base served.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.inference.programs import Kind
from jaxpar.inference.speculative import DETERMINISTIC_TARGET_PROGRAM, DraftSource, _check_round, check_proposals
from jaxpar.models.medusa import fingerprint, same_fingerprint
from jaxpar.runtime import Runtime
from jaxpar.weights import SavedRun, join, same_network, split_weights


def _medusa_round(k, graphdef, kv, params, model_state, cache, tokens, positions, page_table, rows, settings,
                  proposed, limit):
  """The target's pass over [last token, *proposed] with the acceptance test, then the heads'
  next proposals -> (accepted [B], the token after them [B], next proposals [B, k], cache)."""
  model = nnx.merge(graphdef, params, model_state)
  hidden, cache = model.decode_hidden(tokens, positions, cache, page_table, kv, rows)
  accepted, token = check_proposals(model.logits(hidden), None, proposed, settings, jnp.maximum(positions, 0) + 1,
                                    limit)
  last_kept = jnp.take_along_axis(hidden, accepted[:, None, None], axis=1)[:, 0]
  heads = model.medusa.logits(last_kept, model.output_projection())[:, :k]  # [B, k, V]
  return accepted, token, jnp.argmax(heads, axis=-1).astype(jnp.int32), cache


def _medusa_program(k: int) -> Kind:
  return Kind(lambda *args: _medusa_round(k, *args), DETERMINISTIC_TARGET_PROGRAM.extra, ("rows", "rows", "rows"))


class MedusaDraft(DraftSource):
  """Proposals from the served model's Medusa heads, up to `k` a round (default: one per head)."""

  def __init__(self, k: int | None = None):
    if k is not None:
      _check_round(k)
    self.k = k
    self.pending: dict[int, tuple[int, np.ndarray]] = {}  # request id -> (its length then, proposals)

  def bind(self, target):
    cfg = target.runtime.model_config
    if cfg.medusa is None:
      raise ConfigError("speculative medusa: the served model has no draft heads: serve a run trained with "
                        "train.objective=medusa, or attach one with --speculative medusa=HEADS_RUN")
    self.k = self.k or cfg.medusa.heads
    if self.k > cfg.medusa.heads:
      raise ConfigError(f"speculative medusa k={self.k}: the model has {cfg.medusa.heads} draft heads, one "
                        f"proposal each: use k <= {cfg.medusa.heads}")
    _check_round(self.k, target)
    check_base(target.runtime, target.params, target.model_state)
    self.batch = len(target.slots)
    self.target_program = _medusa_program(self.k)

  def propose(self, rows, starts, settings):
    proposed = np.zeros((self.batch, self.k), np.int32)
    limit = np.zeros(self.batch, np.int32)
    for i, request in enumerate(rows):
      length, drafts = self.pending.get(getattr(request, "id", None), (None, None))
      if length is not None and length == request.length:  # proposed for exactly this context
        proposed[i], limit[i] = drafts, self.k
    return proposed, limit, None

  def receive(self, rows, outputs):
    (drafts,) = outputs
    for i, request in enumerate(rows):
      if request is not None and request.finish_reason is None:
        self.pending[request.id] = (request.length, drafts[i])

  def forget(self, request):
    self.pending.pop(request.id, None)


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
