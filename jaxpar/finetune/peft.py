"""Adapters as Hugging Face PEFT files: `jaxpar lora export-peft` and `jaxpar lora import-peft`.

PEFT's LoRA keeps, per adapted `nn.Linear` (weight [out, in]), `lora_A.weight` [rank, in] and
`lora_B.weight` [out, rank] and adds (lora_alpha / r) * B A x. Ours are A [*in, rank] and
B [rank, *out] with the projection's own axes (models/lora.py), flattened in the order the
family's Hugging Face mapping flattens the weight itself (heads major), so the export is a
reshape and a transpose per layer. The files are `adapter_model.safetensors` (keys
`base_model.model.<HF module>.lora_A.weight`) and `adapter_config.json`; `peft` loads them
onto the `transformers` model that `jaxpar convert jaxpar-to-hf` writes from the base.
Adapters on routed experts have no PEFT form here (export refuses them).
"""

import json
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

from jaxpar.checkpoint import TOKENIZER_DIR, Checkpointer
from jaxpar.config import MeshConfig, replace
from jaxpar.data import copy_tokenizer_files
from jaxpar.errors import CheckpointError
from jaxpar.models import get_family
from jaxpar.models.config import PROJECTIONS
from jaxpar.models.transformer import layer_groups
from jaxpar.runtime import Runtime
from jaxpar.weights import SavedRun, lookup, split_weights
from jaxpar.weights.safetensors_file import save_safetensors

_PREFIX = "base_model.model."


def _projections(cfg) -> list[tuple[tuple[str, ...], str, str]]:
  """(our adapter path inside a layer, HF module name after `model.layers.{i}.`, its last
  component: PEFT's target module name) for every adaptable projection of the family."""
  mapping = get_family(cfg.family).hf
  if mapping is None:
    raise CheckpointError(f"model.family={cfg.family!r} has no Hugging Face mapping, so no PEFT form")
  found = []
  for path, name, _ in mapping.layer:
    if path[-1] in PROJECTIONS and "{expert}" not in name and name.endswith(".weight"):
      module = name.removesuffix(".weight")
      found.append((path[:-1] + ("lora", path[-1]), module, module.rsplit(".", 1)[-1]))
  return found


def _layers(params: dict, cfg):
  """(index, that layer's params) over the layer stack, one layer at a time on the host."""
  for i in range(cfg.num_layers):
    stack = params["layers"]
    yield i, (jax.tree.map(lambda x, i=i: x[i], stack) if cfg.scan_layers else stack[i])


def export_peft(ckpt, out) -> Path:
  """Write the adapters of the checkpoint `ckpt` as a PEFT LoRA adapter directory `out`."""
  with SavedRun(ckpt) as run:
    cfg = run.config.model
    if cfg.lora is None:
      raise CheckpointError(f"checkpoint {ckpt} has no adapters (no model.lora in its config)")
    if cfg.lora.experts or len(layer_groups(cfg)) > 1:
      raise CheckpointError(f"checkpoint {ckpt} adapts routed experts or more than one layer group (dense first "
                            "layers, a hybrid's linear layers), which have no PEFT form here: `jaxpar lora merge` "
                            "it and export the merged model instead")
    adapters = split_weights(run.load().runtime, run.params)[0]
  tensors, targets = {}, set()
  for i, layer in _layers(adapters, cfg):
    for path, module, target in _projections(cfg):
      pair = lookup(layer, path)
      if pair is None:
        continue
      a, b = (np.asarray(jax.device_get(pair[k]), np.float32) for k in ("a", "b"))
      rank = a.shape[-1]
      name = f"{_PREFIX}model.layers.{i}.{module}"
      tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, rank).T)
      tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.reshape(rank, -1).T)
      targets.add(target)
  expected = 2 * cfg.num_layers * sum(cfg.lora.targets_projection(p[0][-1]) for p in _projections(cfg))
  if len(tensors) != expected:  # an adapter the family's mapping does not name (a shared expert MLP)
    raise CheckpointError(f"checkpoint {ckpt} has adapters with no Hugging Face module name: merge it instead")
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  save_safetensors(tensors, out / "adapter_model.safetensors")
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
            "lora_dropout": 0.0, "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "base_model_name_or_path": cfg.lora.base}
  (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return out


def _peft_config(peft_dir: Path) -> dict:
  path = peft_dir / "adapter_config.json"
  if not path.is_file() or not (peft_dir / "adapter_model.safetensors").is_file():
    raise CheckpointError(f"{peft_dir} is not a PEFT adapter: it needs adapter_config.json and "
                          "adapter_model.safetensors")
  config = json.loads(path.read_text())
  if config.get("peft_type") != "LORA":
    raise CheckpointError(f"{path}: peft_type={config.get('peft_type')!r}; only LORA adapters are read")
  for key, plain in (("use_rslora", False), ("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
    if config.get(key, plain) != plain:
      raise CheckpointError(f"{path}: {key}={config[key]!r} is not supported; use {key}={plain!r}")
  if config.get("rank_pattern") or config.get("alpha_pattern"):
    raise CheckpointError(f"{path}: per-module rank_pattern/alpha_pattern is not supported (one rank for all)")
  return config


def import_peft(peft_dir, base, out, *, devices=None):
  """A PEFT LoRA adapter directory over the base checkpoint `base` -> an adapter checkpoint
  `out` (step 0, model.lora.base = base) -> (its Config, the written step path)."""
  peft_dir = Path(peft_dir)
  peft = _peft_config(peft_dir)
  tensors = load_file(peft_dir / "adapter_model.safetensors")
  with SavedRun(base) as source:
    cfg = source.config.model
    if len(layer_groups(cfg)) > 1:
      raise CheckpointError(f"{base}: a model with more than one layer group (dense first layers, a hybrid's "
                            "linear layers) takes no PEFT adapter here: merge the adapter in PEFT and convert the result")
    by_target = {target: path[-1] for path, _, target in _projections(cfg)}
    targets = peft["target_modules"]
    targets = [targets] if isinstance(targets, str) else targets
    unknown = sorted(set(targets) - set(by_target))
    if unknown:
      raise CheckpointError(f"{peft_dir}: target module {unknown[0]!r} is not a projection jaxpar adapts "
                            f"({', '.join(sorted(by_target))})")
    lora = {"rank": int(peft["r"]), "alpha": float(peft["lora_alpha"]),
            "targets": sorted(by_target[t] for t in targets), "base": str(Path(base).absolute())}
    config = replace(source.config, model={"lora": lora})
  runtime = Runtime(config.model, MeshConfig(fsdp=-1), devices, parallel=config.parallel)
  abstract = split_weights(runtime, runtime.abstract_params)[0]
  per_layer = [{} for _ in range(cfg.num_layers)]
  for i in range(cfg.num_layers):
    for path, module, target in _projections(cfg):
      pair = lookup(abstract["layers"] if cfg.scan_layers else abstract["layers"][i], path)
      if pair is None:
        continue
      name = f"{_PREFIX}model.layers.{i}.{module}"
      a_shape, b_shape = (pair[k].shape[int(cfg.scan_layers):] for k in ("a", "b"))
      try:
        a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
      except KeyError as missing:
        raise CheckpointError(f"{peft_dir} has no tensor {missing}: the adapter was made for another model") from None
      if a.shape != (a_shape[-1], int(np.prod(a_shape[:-1]))) or b.shape != (int(np.prod(b_shape[1:])), b_shape[0]):
        raise CheckpointError(f"{peft_dir}: {name} has lora_A {a.shape}, lora_B {b.shape}, but the base at {base} "
                              f"needs {(a_shape[-1], int(np.prod(a_shape[:-1])))} and "
                              f"{(int(np.prod(b_shape[1:])), b_shape[0])}")
      _set(per_layer[i], path, {"a": a.T.reshape(a_shape).astype(np.float32),
                                "b": b.T.reshape(b_shape).astype(np.float32)})
  layers = jax.tree.map(lambda *xs: np.stack(xs), *per_layer) if cfg.scan_layers else dict(enumerate(per_layer))
  params = jax.device_put({"layers": layers}, split_weights(runtime, runtime.param_shardings)[0])
  with Checkpointer(out) as target:
    if target.all_steps():
      raise CheckpointError(f"{out} already holds checkpoints {target.all_steps()}: give an empty or new "
                            "directory (nothing is overwritten)")
    target.save(0, {"params": params}, config=config, force=True)
    target.wait()
    copy_tokenizer_files(source.directory / TOKENIZER_DIR, target.directory / TOKENIZER_DIR)
    return config, target.path(0)


def _set(tree: dict, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value
