"""The frozen base under adapters (model.lora): split a model's weights, and load the base.

An adapter checkpoint holds the adapters alone; its config's `model.lora.base` names the
checkpoint of the base weights (None: the model's random init from train.seed, which tests
and benchmarks use). The trainer and `SavedRun.load` both get the base from here.
"""

import jax

from jaxpar.errors import CheckpointError
from jaxpar.finetune.partition import partition


def split_weights(runtime, tree: dict) -> tuple[dict, dict]:
  """(adapters, base) of a params-shaped tree; without adapters (everything, {})."""
  if runtime.adapter_mask is None:
    return tree, {}
  return partition(tree, runtime.adapter_mask)


# Model keys that change how a network runs, not what it computes with its weights.
_HOW_IT_RUNS = {"lora", "max_seq_len", "remat", "scan_unroll", "attention", "mlp_chunks"}


def same_network(ours, theirs) -> bool:
  """Whether two model configs describe the same base network (adapters aside): a base
  trained at one length fine-tunes at another."""
  return ours.model_dump(exclude=_HOW_IT_RUNS) == theirs.model_dump(exclude=_HOW_IT_RUNS)


def load_base(runtime) -> dict:
  """The base weights of an adapted model, placed on the runtime's shardings."""
  _, shardings = split_weights(runtime, runtime.param_shardings)
  path = runtime.model_config.lora.base
  if path is None:
    with runtime.context():
      return jax.jit(lambda: split_weights(runtime, runtime.create()[0])[1], out_shardings=shardings)()
  from jaxpar.saved_run import SavedRun
  with SavedRun(path) as source:
    if source.config.model.lora is not None:
      raise CheckpointError(f"model.lora.base={path} holds adapters itself: merge them into a base first "
                            f"(`jaxpar lora merge {path} OUT`) and point model.lora.base at OUT")
    ours = runtime.model_config
    if ours.quantization is not None and source.config.model.quantization is None:
      return _quantized(runtime, source, shardings)  # QLoRA over a float checkpoint
    if not same_network(ours, source.config.model):
      raise CheckpointError(f"model.lora.base={path} was saved with a different model section: copy its "
                            f"model section ({source.path}/config) into this config and add `lora:` to it")
    _, targets = split_weights(runtime, runtime.abstract_targets()[0])
    return source.read_params(targets)


def _quantized(runtime, source, shardings) -> dict:
  """A float base checkpoint, read and quantized as model.quantization says (QLoRA)."""
  from jaxpar.convert.quantize import quantize_params
  from jaxpar.runtime import Runtime
  plain = runtime.model_config.model_copy(update={"lora": None, "quantization": None})
  if not same_network(plain, source.config.model.model_copy(update={"quantization": None})):
    raise CheckpointError(f"model.lora.base={source.directory} was saved with a different model section: copy "
                          "its model section into this config and add `lora:` and `quantization:` to it")
  floats = Runtime(plain, runtime.mesh_config, runtime.mesh.devices.flat, seed=runtime.seed)
  params = source.read_params(floats.abstract_targets()[0])
  return quantize_params(params, runtime, shardings)
