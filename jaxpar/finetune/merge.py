"""Fold adapters into their base weights: `jaxpar lora merge ADAPTERS OUT`.

W' = W + (alpha / rank) * A @ B for every adapted projection, in float32 and then cast to
the weight's dtype. The merged checkpoint is a plain model (no `model.lora`), which the
engine serves and `jaxpar convert jaxpar-to-hf` exports like any other.
"""

import jax
import jax.numpy as jnp

from jaxpar.checkpoint import TOKENIZER_DIR, Checkpointer
from jaxpar.config import replace
from jaxpar.data import copy_tokenizer_files
from jaxpar.errors import CheckpointError
from jaxpar.models.lora import low_rank_delta
from jaxpar.runtime import Runtime
from jaxpar.weights import SavedRun


def merged_weights(params: dict, scale: float) -> dict:
  """A params tree with adapters (`lora` entries beside the weights they adapt) -> the same
  tree without them, each adapted weight plus its low-rank update."""
  out = {k: merged_weights(v, scale) if isinstance(v, dict) else v for k, v in params.items() if k != "lora"}
  for name, pair in params.get("lora", {}).items():
    weight, a, b = out[name], pair["a"], pair["b"]
    if not hasattr(weight, "dtype"):
      raise CheckpointError(f"adapter {name!r} sits on a quantized weight: merge adapters into a float base "
                            "(train them over the float checkpoint, or merge before quantizing)")
    contract = weight.ndim - b.ndim + 1  # w [*lead, *in, *out], b [*lead, rank, *out]
    delta = low_rank_delta(a.astype(jnp.float32), b.astype(jnp.float32), scale, contract)
    out[name] = (weight.astype(jnp.float32) + delta).astype(weight.dtype)
  return out


def merge_checkpoint(adapters, out, *, devices=None):
  """Merge the adapter checkpoint `adapters` (over its model.lora.base) into a new checkpoint
  directory `out` -> (the merged Config, the written step path)."""
  with SavedRun(adapters) as source:
    lora = source.config.model.lora
    if lora is None:
      raise CheckpointError(f"checkpoint {adapters} has no adapters (no model.lora in its config): nothing to merge")
    if source.config.model.quantization is not None:
      raise CheckpointError(f"checkpoint {adapters} adapts a quantized base: merge adapters into a float base")
    config = replace(source.config, model={"lora": None})
    with Checkpointer(out) as target:
      if target.all_steps():
        raise CheckpointError(f"{out} already holds checkpoints {target.all_steps()}: give an empty or new "
                              "directory (nothing is overwritten)")
      source.load(devices=devices)
      runtime = Runtime(config.model, source.runtime.mesh_config, devices, parallel=config.parallel)
      with runtime.context():
        params = jax.jit(lambda p: merged_weights(p, lora.scale), out_shardings=runtime.param_shardings)(source.params)
      target.save(source.step, {"params": params, "model_state": source.model_state}, config=config, force=True)
      target.wait()
      copy_tokenizer_files(source.directory / TOKENIZER_DIR, target.directory / TOKENIZER_DIR)
      return config, target.path(source.step)
