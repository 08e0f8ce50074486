"""Hugging Face <-> jaxpar, for every registered family with an HF mapping (each family's
is models/families/<name>/hf.py, on the shared decoder layout of models/hf_layout.py:
`llama` for Llama 2/3, Mistral, Qwen2/2.5, Qwen3; `mixtral`; `qwen3_moe`; `deepseek`;
`gemma2` and `gemma3`; `gpt_oss`). HF stores layers
(and experts) one tensor each; ours are stacked on leading `layers` (and `experts`) axes,
per layer group (`first_dense_layers`: `dense_layers`, then `layers`; a hybrid's other mixer: its own group,
e.g. `gated_deltanet_layers`). Parameters HF keeps in one tensor are read and written as
`Rows` parts of it (models/hf_layout.py).

Import reads `config.json` and the `*.safetensors` files (sharded or not) tensor by tensor;
each device reads only the slice of each tensor that its shard holds, so a model never has
to fit on one device or in host memory. Export gathers one layer of one tensor at a time.
"""

import dataclasses
import itertools
import json
import logging
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxpar.checkpoint import TOKENIZER_DIR, Checkpointer
from jaxpar.config import Config, DataConfig, MeshConfig, ModelConfig, from_dict
from jaxpar.convert.byte_tokenizer import write_byte_tokenizer
from jaxpar.data import copy_tokenizer_files
from jaxpar.data.chat_batches import chat_template_text
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.models import family_names, get_family
from jaxpar.models.hf_layout import Rows
from jaxpar.models.transformer import layer_groups
from jaxpar.runtime import Runtime
from jaxpar.weights import SavedRun, lookup
from jaxpar.weights.safetensors_file import save_safetensors

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_log = logging.getLogger(__name__)


# -- configs ---------------------------------------------------------------------------

def _mapping_for_type(model_type):
  """The registered family that imports HF `model_type`."""
  supported = []
  for name in family_names():
    mapping = get_family(name).hf
    if mapping is not None:
      if model_type in mapping.model_types:
        return mapping
      supported += mapping.model_types
  raise CheckpointError(f"config.json model_type={model_type!r} is not supported; use one of {supported}")


def _mapping_for_family(cfg: ModelConfig):
  mapping = get_family(cfg.family).hf
  if mapping is None:
    raise CheckpointError(f"model.family={cfg.family!r} has no Hugging Face mapping")
  return mapping


def model_config_from_hf(hf: dict) -> ModelConfig:
  return _mapping_for_type(hf.get("model_type")).config_from_hf(hf)


def hf_config_from_model(cfg: ModelConfig, dtype: str) -> dict:
  return _mapping_for_family(cfg).config_to_hf(cfg, dtype)


# -- layouts ---------------------------------------------------------------------------

def _span(index: slice, size: int) -> tuple[int, int]:
  start, stop, _ = index.indices(size)
  return start, stop


# Two of our parameters that HF stores as one, their last axes interleaved (GPT-OSS's
# gate_up_proj: gate in the even columns, up in the odd ones).
_INTERLEAVED = ("even_columns", "odd_columns")
# Two of our expert parameters [experts, embed, F] that HF stores as one tensor's halves,
# transposed (Gemma 4's gate_up_proj [experts, 2F, embed]: the gate's rows, then up's).
_HALVES = ("first_half_rows", "second_half_rows")


@dataclasses.dataclass(frozen=True)
class _RowSpan:
  """Where one `Rows` part lies in its HF tensor: rows [start, stop) of every `period` rows;
  `rows` of them in all, of the tensor's `total`; read in `layout`."""
  layout: str
  start: int
  stop: int
  period: int
  rows: int
  total: int

  def hf_rows(self, rows: np.ndarray) -> np.ndarray:
    width = self.stop - self.start
    return rows // width * self.period + self.start + rows % width


def _row_count(layout: str, shape: tuple) -> int:
  """The HF tensor's first-axis rows that one layer's parameter of `shape` fills."""
  return shape[1] * shape[2] if layout in ("heads_in", "conv") else shape[-1] if layout == "transpose" else shape[0]


def _row_span(rows: Rows, layer0, lead: int, cfg) -> _RowSpan:
  counts = [_row_count(rows.layout, _get(layer0, path).shape[lead:]) for path in rows.parts]
  groups = rows.groups(cfg) if rows.groups else 1
  widths = [count // groups for count in counts]
  start = sum(widths[:rows.part])
  return _RowSpan(rows.layout, start, start + widths[rows.part], sum(widths), counts[rows.part], sum(counts))


class _RowView:
  """The rows of one _RowSpan of an HF tensor, sliced as a tensor of their own."""

  def __init__(self, tensor, span: _RowSpan):
    self.tensor, self.span = tensor, span

  def __getitem__(self, index):
    index = index if isinstance(index, tuple) else (index,)
    rows = self.span.hf_rows(np.arange(self.span.rows)[index[0]])
    block = np.asarray(self.tensor[(slice(int(rows.min()), int(rows.max()) + 1),) + tuple(index[1:])])
    return block[rows - rows.min()]


def _open(source, name: str, layout):
  tensor = source.slice(name)
  return _RowView(tensor, layout) if isinstance(layout, _RowSpan) else tensor


def _read_shard(layout, tensor, shape: tuple, index: tuple) -> np.ndarray:
  """Our-layout shard `index` of an HF tensor, reading only the HF slice it needs. A heads
  layout's head dim is our parameter's own (multi-head latent attention's differ)."""
  layout = getattr(layout, "layout", layout)  # a _RowSpan's tensor is already its rows
  if layout == "same":
    return tensor[index]
  if layout in _INTERLEAVED:  # ours [..., F] <- every other column of HF [..., 2F]
    start, stop = _span(index[-1], shape[-1])
    return tensor[index[:-1] + (slice(2 * start + _INTERLEAVED.index(layout), 2 * stop, 2),)]
  if layout == "transpose":
    return tensor[index[1], index[0]].T
  if layout in _HALVES:  # ours [X, E, F] <- rows h F + [0, F) of HF [X, 2F, E], transposed
    start, stop = _span(index[2], shape[2])
    offset = _HALVES.index(layout) * shape[2]
    return np.asarray(tensor[index[0], offset + start:offset + stop, index[1]]).transpose(0, 2, 1)
  if layout == "swap_last":  # ours [X, A, B] <- HF [X, B, A] (Gemma 4's down_proj)
    return np.asarray(tensor[index[0], index[2], index[1]]).transpose(0, 2, 1)
  if layout == "per_head_4d":  # ours [H] <- HF [1, 1, H, 1] (Kimi's A_log)
    return np.asarray(tensor[:, :, index[0], :]).reshape(-1)
  if layout == "conv":  # ours [K, H, D] <- HF [H*D, 1, K] (a depthwise conv1d's weight)
    head_dim = shape[2]
    start, stop = _span(index[1], shape[1])
    block = tensor[slice(start * head_dim, stop * head_dim), slice(None), index[0]]
    return np.asarray(block)[:, 0].T.reshape(-1, stop - start, head_dim)[:, :, index[2]]
  heads = _span(index[1] if layout == "heads_in" else index[0], shape[1 if layout == "heads_in" else 0])
  head_dim = shape[2] if layout == "heads_in" else shape[1]
  rows = slice(heads[0] * head_dim, heads[1] * head_dim)
  n = heads[1] - heads[0]
  if layout == "heads_in":  # ours [E, H, D] <- HF [H*D, E]
    return tensor[rows, index[0]].T.reshape(-1, n, head_dim)[:, :, index[2]]
  if layout == "heads_out":  # ours [H, D, E] <- HF [E, H*D]
    return tensor[index[2], rows].T.reshape(n, head_dim, -1)[:, index[1], :]
  return tensor[rows].reshape(n, head_dim)[:, index[1]]  # heads_bias: ours [H, D] <- HF [H*D]


def _to_hf(layout, x: np.ndarray) -> np.ndarray:
  layout = getattr(layout, "layout", layout)
  if layout == "conv":
    x = x.reshape(x.shape[0], -1).T[:, None, :]
  elif layout == "transpose":
    x = x.T
  elif layout in _HALVES or layout == "swap_last":
    x = x.transpose(0, 2, 1)
  elif layout == "heads_in":
    x = x.reshape(x.shape[0], -1).T
  elif layout == "heads_out":
    x = x.reshape(-1, x.shape[-1]).T
  elif layout == "heads_bias":
    x = x.reshape(-1)
  elif layout == "per_head_4d":
    x = x.reshape(1, 1, -1, 1)
  return np.ascontiguousarray(x)


def _entries(params: dict, cfg: ModelConfig):
  """(our full path, HF name, layout, index into our array's leading stacked axes) for every
  HF tensor of the model held in `params` (the parameters, or the model state: DeepSeek's
  router bias). The index is () for an unstacked tensor, (layer,) for a layer of
  a scanned stack, plus (expert,) for names with an `{expert}` field."""
  mapping = _mapping_for_family(cfg)
  for path, name, layout in mapping.top:
    if lookup(params, path) is not None:
      yield path, name, layout, ()
  for group in layer_groups(cfg):
    if group.name not in params:
      continue  # model state: a group without variables (dense layers have no router bias)
    layer0 = params[group.name] if cfg.scan_layers else params[group.name][0]
    for path, name, layout in mapping.entries(group.name):
      if lookup(layer0, path) is None:
        continue
      if isinstance(layout, Rows):
        layout = _row_span(layout, layer0, int(cfg.scan_layers), cfg)
      experts = range(_get(layer0, path).shape[int(cfg.scan_layers)]) if "{expert}" in name else [None]
      for i in range(group.count):
        ours = (group.name,) + path if cfg.scan_layers else (group.name, i) + path
        for j in experts:
          index = (i,) * cfg.scan_layers + (() if j is None else (j,))
          yield ours, f"model.layers.{group.indices[i]}.{name}".format(expert=j), layout, index


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


# -- import ----------------------------------------------------------------------------

class _SafetensorsDir:
  """Lazy, sliceable access to every tensor of an HF directory (one file or a sharded index)."""

  def __init__(self, hf_dir: Path):
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
      files = {name: hf_dir / f for name, f in json.loads(index.read_text())["weight_map"].items()}
    else:
      single = hf_dir / "model.safetensors"
      if not single.is_file():
        raise CheckpointError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json: "
                         "save the model with safe_serialization (the transformers default)")
      with safe_open(single, "numpy") as f:
        files = {name: single for name in f.keys()}
    self.files = files
    self._open = {}

  def __contains__(self, name):
    return name in self.files

  def slice(self, name):
    file = self.files[name]
    if file not in self._open:
      self._open[file] = safe_open(file, "numpy")
    return self._open[file].get_slice(name)

  def close(self):
    self._open.clear()  # the handles close (and unmap their files) when dropped


def _import_param(source, names: np.ndarray, layout, sharding, shape, dtype):
  """One parameter built shard by shard straight onto its devices. `names` holds the HF
  tensor of each index of the leading stacked axes (layers, experts; 0-d: unstacked)."""
  lead = names.ndim

  def shard(index):
    spans = [range(*_span(index[a], shape[a])) for a in range(lead)]
    blocks = [_read_shard(layout, _open(source, names[i], layout), shape[lead:], index[lead:])
              for i in itertools.product(*spans)]
    return np.stack(blocks).reshape(*map(len, spans), *blocks[0].shape).astype(dtype)
  return jax.make_array_from_callback(shape, sharding, shard)


def hf_to_jaxpar(hf_dir, out, *, mesh: MeshConfig = MeshConfig(), param_dtype: str = "float32",
                 tokenizer=None) -> Config:
  """Convert an HF checkpoint directory into a weights-only jaxpar checkpoint at `out`
  (params and model state, such as DeepSeek's router bias; step 0; `jaxpar train --restore
  OUT` fine-tunes it). Returns the jaxpar config.
  `tokenizer`: where the tokenizer is when `hf_dir` has none (a tokenizer.json, or a
  directory holding one), or "byte" for a model trained on jaxpar's byte tokens."""
  hf_dir = Path(hf_dir)
  if not (hf_dir / "config.json").is_file():
    raise CheckpointError(f"{hf_dir} has no config.json: give a Hugging Face model directory")
  if tokenizer not in (None, "byte") and not _tokenizer_json(Path(tokenizer)).is_file():
    raise CheckpointError(f"--tokenizer {tokenizer}: no tokenizer.json there; give a tokenizer.json "
                          "or a directory holding one")
  hf = json.loads((hf_dir / "config.json").read_text())
  model = model_config_from_hf(hf).model_copy(update={"param_dtype": param_dtype})
  config = from_dict({"model": model.model_dump(), "mesh": mesh.model_dump(),
                      "data": {"seq_len": min(DataConfig().seq_len, model.max_seq_len)}})
  runtime = Runtime(config.model, config.mesh)
  source = _SafetensorsDir(hf_dir)
  try:
    params = _import_tree(source, runtime.abstract_params, runtime.param_shardings, config.model,
                          hf, hf_dir, DTYPES[param_dtype])
    # Model state (a router bias) keeps its own dtype: transformers keeps it in float32 too.
    model_state = _import_tree(source, runtime.abstract_model_state, runtime.model_state_shardings,
                               config.model, hf, hf_dir, None)
  finally:
    source.close()
  with Checkpointer(out) as checkpoints:
    checkpoints.save(0, {"params": params, "model_state": model_state}, config=config, force=True)
  _bundle_tokenizer(hf_dir, tokenizer, Path(out) / TOKENIZER_DIR)
  return config


def _import_tree(source, abstract: dict, shardings: dict, cfg: ModelConfig, hf: dict, hf_dir: Path, dtype):
  """The arrays of `abstract` (params or model state) that the HF mapping names, read from
  `source` onto their shardings, in `dtype` (None: the abstract array's own)."""
  names, alternatives = {}, _mapping_for_family(cfg).alternative_names
  for path, name, layout, index in _entries(abstract, cfg):
    names.setdefault(path, (layout, {}))[1][index] = _name_in(source, name, alternatives)
  tree = {}
  for path, (layout, by_index) in names.items():
    missing = [n for n in by_index.values() if n not in source]
    if missing:
      raise CheckpointError(f"{hf_dir} has no tensor {missing[0]!r} that a {hf['model_type']} model with "
                            "this config.json needs: the checkpoint is incomplete or of another architecture")
    target = _get(abstract, path)
    hf_names = np.empty(target.shape[:len(next(iter(by_index)))], object)
    for index, name in by_index.items():
      hf_names[index] = name
    _set(tree, path, _import_param(source, hf_names, layout, _get(shardings, path), target.shape,
                                   dtype or target.dtype))
  return tree


def _name_in(source, name: str, alternatives) -> str:
  """`name`, or the first of its alternative spellings (HFMapping.alternative_names) that
  `source` holds; `name` when none does."""
  for part, other in alternatives:
    if name not in source and part in name and name.replace(part, other) in source:
      return name.replace(part, other)
  return name


def _tokenizer_json(path: Path) -> Path:
  return path / "tokenizer.json" if path.is_dir() else path


def _bundle_tokenizer(hf_dir: Path, tokenizer, target: Path):
  """The tokenizer goes beside the weights, so the converted model generates text with no
  flags; without one, generation refuses rather than print byte-fallback garbage."""
  if tokenizer == "byte":
    write_byte_tokenizer(target)
  elif "tokenizer.json" not in copy_tokenizer_files(tokenizer or hf_dir, target):
    _log.warning(f"{hf_dir} has no tokenizer.json, so the converted model has no tokenizer and will "
                 "not generate text: convert again with --tokenizer PATH (a tokenizer.json or a model "
                 "directory holding one; Python: tokenizer=PATH), or --tokenizer byte for jaxpar's byte tokens")


# -- export ----------------------------------------------------------------------------

def _set_chat_template(out: Path, template: str):
  """Write `template` into out/tokenizer_config.json (where transformers reads it)."""
  path = out / "tokenizer_config.json"
  settings = json.loads(path.read_text()) if path.is_file() else {}
  settings["chat_template"] = template
  path.write_text(json.dumps(settings, indent=2) + "\n")
  (out / "chat_template.jinja").unlink(missing_ok=True)  # it would take precedence over the one above


def jaxpar_to_hf(ckpt, out, *, dtype: str | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
  """Write a jaxpar checkpoint's parameters as an HF directory that `transformers` loads
  (config.json + safetensors, sharded with an index past `max_shard_bytes`). `dtype`
  defaults to the checkpoint's model.param_dtype."""
  with SavedRun(ckpt) as run:
    cfg = run.config.model
    if cfg.quantization is not None:
      raise CheckpointError(f"checkpoint {run.directory} is quantized (model.quantization.mode="
                            f"{cfg.quantization.mode}): export the float checkpoint it came from")
    if cfg.lora is not None:
      raise CheckpointError(f"checkpoint {run.directory} holds LoRA adapters: `jaxpar lora merge` it first, "
                            "or write the adapters alone with `jaxpar lora export-peft`")
    if cfg.medusa is not None:
      raise CheckpointError(f"checkpoint {run.directory} holds Medusa draft heads over {cfg.medusa.base}: export "
                            "that base, and the heads with `jaxpar convert medusa-heads`")
    dtype = dtype or cfg.param_dtype
    if dtype not in DTYPES:
      raise ConfigError(f"dtype={dtype!r} is not one of {list(DTYPES)}")
    run.load()
    params, model_state, root = run.params, run.model_state, run.directory
    byte_level = run.config.data.tokenizer == "byte" and not run.lacks_tokenizer
    template = run.config.data.chat_template
    template = chat_template_text(template, None) if template else None  # before anything is written
  out = Path(out)
  out.mkdir(parents=True, exist_ok=True)
  if not copy_tokenizer_files(root / TOKENIZER_DIR, out) and byte_level:
    write_byte_tokenizer(out)  # what AutoTokenizer needs to read the byte-level model
  if template:  # the template the run trained with: apply_chat_template renders the same prompts
    _set_chat_template(out, template)
  (out / "config.json").write_text(json.dumps(hf_config_from_model(cfg, dtype), indent=2) + "\n")
  shards, current, size = [], {}, 0
  # Parameters in `dtype`; model state (a router bias) in its own, float32, as transformers keeps it.
  parts = {}
  for tree, to in ((params, DTYPES[dtype]), (model_state, None)):
    for path, name, layout, index in _entries(tree, cfg):
      parts.setdefault(name, (tree, to, []))[2].append((path, layout, index))
  for name, (tree, to, tensor_parts) in parts.items():
    tensor = _hf_tensor(tree, tensor_parts, to)
    if current and size + tensor.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = tensor
    size += tensor.nbytes
  shards.append(current)
  _write_shards(out, shards)
  return out


def _hf_tensor(params, parts, dtype) -> np.ndarray:
  """One HF tensor from its parts, (our path, layout, index) each, one layer (of one expert)
  at a time on the host: one part, the two that HF interleaves, or the row parts (`Rows`) it
  stacks, or the two halves it stacks; in `dtype` (None: as stored)."""
  leaves = {layout: np.asarray(jax.device_get(_get(params, path)[index])) for path, layout, index in parts}
  arrays = {layout: _to_hf(layout, leaf if dtype is None else leaf.astype(dtype)) for layout, leaf in leaves.items()}
  if len(arrays) == 1:
    return next(iter(arrays.values()))
  if all(isinstance(layout, _RowSpan) for layout in arrays):
    first = next(iter(arrays.values()))
    tensor = np.empty((next(iter(arrays)).total, *first.shape[1:]), first.dtype)
    for span, array in arrays.items():
      tensor[span.hf_rows(np.arange(span.rows))] = array
    return tensor
  if set(arrays) == set(_HALVES):
    return np.concatenate([arrays[layout] for layout in _HALVES], axis=-2)
  even, odd = (arrays[layout] for layout in _INTERLEAVED)
  return np.stack([even, odd], axis=-1).reshape(*even.shape[:-1], -1)


def _write_shards(out: Path, shards: list[dict]):
  if len(shards) == 1:
    save_safetensors(shards[0], out / "model.safetensors")
    return
  weight_map, total = {}, 0
  for i, tensors in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_safetensors(tensors, out / file)
    weight_map.update(dict.fromkeys(tensors, file))
    total += sum(t.nbytes for t in tensors.values())
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
