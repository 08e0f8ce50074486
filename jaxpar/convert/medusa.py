"""Draft heads out in the Medusa project's layout (github.com/FasterDecoding/Medusa).

That project keeps a model's heads beside its base, not inside it: `medusa_lm_head.safetensors`
holds, per head h, `h.l.linear.weight` [embed, embed] and `h.l.linear.bias` [embed] for each
residual block l (torch's [out, in] orientation), then `h.L.weight` [vocab, embed], the head's
output projection (L: the block count); `config.json` names the count of heads and blocks
(`medusa_num_heads`, `medusa_num_layers`) and the base (`base_model_name_or_path`). Its loader
and TensorRT-LLM's Medusa converter read these names; no registry or `transformers` class
defines them, so this layout is the project's, the nearest thing to a standard there is.
A head with jaxpar's `shared_projection` is written with the base's projection as its own.
"""

import json
from pathlib import Path

import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.weights import open_run
from jaxpar.weights.safetensors_file import save_safetensors


def export_medusa_heads(path, out) -> Path:
  """The draft heads of the run at `path` (trained with train.objective=medusa), with its
  base's output projection, written to the directory `out` -> out."""
  with open_run(path) as run:
    cfg = run.config.model
    if cfg.medusa is None:
      raise ConfigError(f"{path} has no draft heads: give a run trained with train.objective=medusa")
    if cfg.final_logit_soft_cap is not None:
      raise ConfigError(f"{path}'s model soft-caps its logits, which the Medusa project's heads do not: "
                        "serve its heads with jaxpar instead")
    model = run.model
    heads = model.medusa
    projection = np.asarray(model.output_projection(), np.float32)  # [embed, vocab]
    w, b = np.asarray(heads.w[...], np.float32), np.asarray(heads.b[...], np.float32)
    tensors = {}
    for head in range(cfg.medusa.heads):
      for layer in range(cfg.medusa.layers):
        tensors[f"{head}.{layer}.linear.weight"] = np.ascontiguousarray(w[head, layer].T)
        tensors[f"{head}.{layer}.linear.bias"] = b[head, layer]
      own = projection + (np.asarray(heads.delta[head], np.float32) if hasattr(heads, "delta") else 0.0)
      tensors[f"{head}.{cfg.medusa.layers}.weight"] = np.ascontiguousarray(own.T)
    base = cfg.medusa.base
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  save_safetensors(tensors, out / "medusa_lm_head.safetensors")
  (out / "config.json").write_text(json.dumps({
      "medusa_num_heads": cfg.medusa.heads, "medusa_num_layers": cfg.medusa.layers,
      "base_model_name_or_path": base, "hidden_size": cfg.embed_dim, "vocab_size": cfg.vocab_size}, indent=2))
  return out
