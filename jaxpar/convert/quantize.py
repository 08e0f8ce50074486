"""Post-training quantization of a checkpoint: `jaxpar quantize CKPT OUT --mode ...`.

Reads a float checkpoint onto the current devices, quantizes every projection kernel the
quantized model holds (attention q/k/v/o, MLP gate/up/down: `models/dense.py`), copies the
rest (embeddings, norms) unchanged, and writes a params-only Orbax checkpoint whose saved
config carries `model.quantization`, with the source's tokenizer files. Like any checkpoint it restores onto any mesh, each
device reading only its shards; the engine, evaluation and `Runtime.restore` load
it from that config.
"""

from jaxpar.checkpoint import TOKENIZER_DIR, Checkpointer
from jaxpar.config import replace
from jaxpar.data import copy_tokenizer_files
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.runtime import Runtime
from jaxpar.weights import SavedRun, quantize_params


INT4_GROUP_SIZES = (128, 64, 32)  # model.quantization.group_size's choices, widest first


def default_group_size(model) -> int:
  """The widest int4 group that divides every contracted dim of `model` (a ModelConfig):
  128 for the usual widths, less for small models (tiny's head_dim is 32)."""
  dims = {"embed_dim": model.embed_dim, "head_dim": model.head_dim, "mlp_dim": model.mlp_dim}
  for size in INT4_GROUP_SIZES:
    if all(d % size == 0 for d in dims.values()):
      return size
  raise ConfigError(f"no int4 group size in {INT4_GROUP_SIZES} divides {dims}: quantize with --mode int8")


def quantization_section(mode: str, group_size=None, zero_point=False, outlier_channels=0, model=None) -> dict:
  """The `model.quantization` section for these options (int4: the group size given, or the
  widest that fits `model`, or 128 without one)."""
  section = {"mode": mode}
  if mode == "int4":
    default = default_group_size(model) if model is not None else INT4_GROUP_SIZES[0]
    section.update(group_size=group_size or default, zero_point=zero_point)
  elif group_size is not None or zero_point:
    raise ConfigError(f"--group-size / --zero-point apply to --mode int4 only, not --mode {mode}")
  if outlier_channels:
    section["outlier_channels"] = outlier_channels
  return section


def quantize_checkpoint(ckpt, out, mode: str, group_size=None, *, zero_point=False,
                        outlier_channels=0, devices=None):
  """Quantize the saved run at `ckpt` (a run dir, its checkpoints/ dir, or one step dir) into a
  new checkpoint directory `out` -> (quantized Config, path of the written step)."""
  with SavedRun(ckpt) as source:
    config = source.config
    if config.model.quantization is not None:
      raise CheckpointError(f"checkpoint {ckpt} is already quantized (model.quantization.mode="
                            f"{config.model.quantization.mode}): quantize the float checkpoint instead")
    quant_config = replace(config, model={"quantization": quantization_section(
        mode, group_size, zero_point, outlier_channels, config.model)})
    with Checkpointer(out) as target:
      if target.all_steps():
        raise CheckpointError(f"{out} already holds checkpoints {target.all_steps()}: give an empty "
                              "or new directory (nothing is overwritten)")
      source.load(devices=devices)
      quantized = quantize_params(source.params, Runtime(quant_config.model, source.runtime.mesh_config,
                                                         devices, parallel=quant_config.parallel))
      target.save(source.step, {"params": quantized}, config=quant_config, force=True)
      target.wait()
      # The tokenizer travels with the weights, so the quantized model generates with no flags.
      copy_tokenizer_files(source.directory / TOKENIZER_DIR, target.directory / TOKENIZER_DIR)
      return quant_config, target.path(source.step)
