"""Nested parameter dicts: split what trains from what stays frozen, join them back, look up a
path. A model with adapters (model.lora) trains only its adapters: the train state's `params`
hold those, its `frozen` the base weights, so the optimizer state, the gradients and the
checkpoints cover the adapters alone. `mask` is a tree of bools shaped like the params
(Runtime.adapter_mask): True for an adapter leaf.
"""


def partition(tree: dict, mask: dict) -> tuple[dict, dict]:
  """(leaves where mask is True, the rest), each a nested dict keeping only its own leaves."""
  chosen, rest = {}, {}
  for key, value in tree.items():
    if isinstance(value, dict):
      a, b = partition(value, mask[key])
      if a:
        chosen[key] = a
      if b:
        rest[key] = b
    elif mask[key]:
      chosen[key] = value
    else:
      rest[key] = value
  return chosen, rest


def join(a: dict, b: dict) -> dict:
  """The union of two nested dicts with disjoint leaves (partition's inverse)."""
  out = dict(a)
  for key, value in b.items():
    out[key] = join(out[key], value) if key in out else value
  return out


def lookup(tree, path):
  """The leaf or subtree of nested dicts at `path`, or None where the path is absent."""
  for key in path:
    if not isinstance(tree, dict) or key not in tree:
      return None
    tree = tree[key]
  return tree
