"""Load what generation needs from a checkpoint: model config, weights, tokenizer.

A checkpoint directory may carry its tokenizer in `tokenizer/` (`jaxpar convert
hf-to-jaxpar` copies the Hugging Face files there, `jaxpar train` copies the file it
trained with); otherwise the saved config's `data.tokenizer` is used.
"""

from pathlib import Path

from jaxpar.checkpoint import TOKENIZER_DIR, Checkpointer, resolve
from jaxpar.config import MeshConfig, model_from_dict
from jaxpar.data import load_tokenizer
from jaxpar.runtime import Runtime

def checkpoint_tokenizer(root: Path, saved_config: dict):
  """The checkpoint's own tokenizer files, else the one its config trained with."""
  bundled = Path(root) / TOKENIZER_DIR
  if (bundled / "tokenizer.json").is_file():
    return load_tokenizer(str(bundled))
  spec = saved_config.get("data", {}).get("tokenizer", "byte")
  try:
    return load_tokenizer(spec)
  except ValueError:
    raise ValueError(f"checkpoint {root} has no {TOKENIZER_DIR}/tokenizer.json and its config's "
                     f"tokenizer {spec!r} is not there any more: pass a tokenizer") from None


def load_checkpoint(path, *, mesh=None, devices=None, step: int | None = None):
  """(runtime, params, model_state, tokenizer) for generating from a jaxpar checkpoint
  (a checkpoint dir: its latest step; or one step dir) on `mesh` (a MeshConfig or dict of
  axis sizes; default: data parallel, every device holding the whole model, which suits
  models that fit one device; larger ones set `tensor`)."""
  root, found = resolve(path)
  step = step if step is not None else found
  with Checkpointer(root, read_only=True) as checkpoints:
    saved = checkpoints.saved_config(step)
  if not saved:
    raise ValueError(f"checkpoint {root} has no saved config: it was not written by jaxpar")
  mesh = mesh if isinstance(mesh, MeshConfig) else MeshConfig(**(mesh or {"data": -1, "fsdp": 1}))
  runtime = Runtime(model_from_dict(saved["model"]), mesh, devices)
  params, model_state = runtime.restore(path, step)
  return runtime, params, model_state, checkpoint_tokenizer(root, saved)
