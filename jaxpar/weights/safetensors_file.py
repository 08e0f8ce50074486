"""Writing a safetensors file the way Hugging Face tools expect to find it."""

import os
from pathlib import Path

from safetensors.numpy import save_file


def save_safetensors(tensors: dict, path: Path):
  """`format: pt` metadata (transformers and peft look for it), and the mode every other new
  file gets (0644 under the usual umask; safetensors' writer alone makes 0600)."""
  save_file(tensors, path, metadata={"format": "pt"})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)
