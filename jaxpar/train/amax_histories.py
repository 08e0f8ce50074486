"""fp8_delayed's scaling histories in the train step: the model state's AmaxHistory leaves
(models/low_precision_delayed.py) taken apart so the gradient can take them as an input, and
the gradients' maxima their cotangents carry written into their third rows."""

import jax

from jaxpar.models.low_precision_delayed import NAME, rolled
from jaxpar.trees import join, partition


def _is_history(path, _):
  return str(getattr(path[-1], "key", path[-1])).endswith(NAME)


def split_histories(model_state: dict) -> tuple[dict, dict]:
  """(the AmaxHistory leaves of a model_state dict, the rest)."""
  mask = jax.tree_util.tree_map_with_path(_is_history, model_state)
  return partition(model_state, mask)


def record_gradient_maxima(model_state: dict, cotangents: dict) -> dict:
  """model_state (after a forward pass) with each history's gradient row rolled with the
  maximum its cotangent carries (`cotangents`: split_histories' first part's gradient)."""
  histories, rest = split_histories(model_state)

  def record(history, cotangent):  # [..., 3, H], stacked layers in front
    return history.at[..., 2, :].set(rolled(history[..., 2, :], cotangent[..., 2, 0]))
  return join(rest, jax.tree.map(record, histories, cotangents))
