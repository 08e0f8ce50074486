"""Which weights train and which stay frozen: the adapters or draft heads and the base under
them (model.lora, model.medusa), and whether two model sections describe the same base network."""

from jaxpar.trees import partition


def split_weights(runtime, tree: dict) -> tuple[dict, dict]:
  """(adapters or heads, base) of a params-shaped tree; when the whole model trains (everything, {})."""
  if runtime.adapter_mask is None:
    return tree, {}
  return partition(tree, runtime.adapter_mask)


# Model keys that change how a network runs, not what it computes with its weights.
_HOW_IT_RUNS = {"lora", "medusa", "max_seq_len", "remat", "scan_unroll", "attention", "mlp_chunks"}


def same_network(ours, theirs) -> bool:
  """Whether two model configs describe the same base network (adapters and heads aside): a base
  trained at one length fine-tunes at another."""
  return ours.model_dump(exclude=_HOW_IT_RUNS) == theirs.model_dump(exclude=_HOW_IT_RUNS)
