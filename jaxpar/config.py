"""One frozen, validated experiment config: YAML file + dotted command-line overrides.

Every error is one line that names the key, the bad value and what would be valid.
"""

import importlib.resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
  """A config problem the user can fix; the message is one line."""


class _Frozen(BaseModel):
  model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class RopeScaling(_Frozen):
  """Llama-3 style frequency scaling of RoPE."""
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


class ModelConfig(_Frozen):
  vocab_size: int = 512
  embed_dim: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 32
  mlp_dim: int = 512
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qk_norm: bool = False
  attention_bias: bool = False  # q/k/v projection biases (Qwen2 / Qwen2.5)
  param_dtype: Literal["float32", "bfloat16"] = "float32"
  compute_dtype: Literal["float32", "bfloat16"] = "float32"
  scan_layers: bool = True
  # Layers per scan iteration. On CPU, unrolling a small stack halves the backward time
  # (XLA CPU runs the while loop's per-layer gradient updates poorly); compile time grows.
  scan_unroll: int = 1
  remat: Literal["none", "full", "save_dots", "save_dots_no_batch"] = "none"
  attention: Literal["auto", "flash", "reference", "chunked"] = "auto"

  @model_validator(mode="after")
  def _heads(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"model.num_kv_heads={self.num_kv_heads} must divide "
                       f"model.num_heads={self.num_heads}")
    return self


MESH_AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")


class MeshConfig(_Frozen):
  """Mesh axis sizes, slowest link first. One axis may be -1: 'the rest of the devices'."""
  data: int = 1
  stage: int = 1
  fsdp: int = -1
  context: int = 1
  expert: int = 1
  tensor: int = 1
  num_slices: int = 1
  dcn_axis: Literal["data", "fsdp", "stage"] = "data"
  rules: str | list[tuple[str, str | list[str] | None]] = "fsdp_tp"
  topology: str | None = None  # the TPU slice this config is sized for, e.g. v6e-256

  @model_validator(mode="after")
  def _sizes(self):
    sizes = self.axis_sizes()
    bad = [f"mesh.{a}={s}" for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
      raise ValueError(f"{bad[0]} is invalid: use a positive size, or -1 for the rest of the devices")
    if sum(s == -1 for s in sizes.values()) > 1:
      raise ValueError("only one mesh axis may be -1 (the rest of the devices); "
                       f"got {[a for a, s in sizes.items() if s == -1]}")
    return self

  def axis_sizes(self) -> dict[str, int]:
    return {a: getattr(self, a) for a in MESH_AXES}


class DataConfig(_Frozen):
  source: str = "bundled"
  text_key: str = "text"
  tokenizer: str = "byte"
  seq_len: int = 128
  global_batch_size: int = 16
  shuffle_seed: int = 0

  @model_validator(mode="after")
  def _paths_exist(self):
    if self.source != "bundled" and not Path(self.source).exists():
      raise ValueError(f"data.source={self.source!r} does not exist: give a .txt/.jsonl file, "
                       "a folder of them, or 'bundled'")
    if self.tokenizer != "byte" and not Path(self.tokenizer).exists():
      raise ValueError(f"data.tokenizer={self.tokenizer!r} does not exist: give the path of a "
                       "Hugging Face tokenizer.json, or 'byte'")
    return self


class TrainConfig(_Frozen):
  steps: int = 300
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  grad_clip: float | None = 1.0
  z_loss: float = 0.0
  microbatches: int = 1
  # Sequence positions per chunk of the fused output-projection + loss (0: plain logits).
  logits_chunk_len: int = 128
  seed: int = 0
  log_every: int = 10
  run_dir: str = "runs/default"
  peak_flops_per_device: float | None = None
  sample_prompt: str = "The "
  sample_tokens: int = 64


class CheckpointConfig(_Frozen):
  """Orbax checkpoints of the train state, data iterator state and config."""
  enabled: bool = True
  every_steps: int | None = Field(500, ge=1)  # None: no step schedule
  every_minutes: float | None = Field(None, gt=0)  # also save when this much time has passed
  keep_last: int | None = Field(3, ge=1)  # None: keep all
  keep_every: int | None = Field(None, ge=1)  # also keep steps that are multiples of this
  async_save: bool = True
  dir: str | None = None  # default: <train.run_dir>/checkpoints


class Config(_Frozen):
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()

  @model_validator(mode="after")
  def _consistent(self):
    m, d, t = self.model, self.data, self.train
    if d.seq_len > m.max_seq_len:
      raise ValueError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                       "lower data.seq_len or raise model.max_seq_len")
    if d.global_batch_size % t.microbatches:
      raise ValueError(f"train.microbatches={t.microbatches} must divide "
                       f"data.global_batch_size={d.global_batch_size}")
    if self.mesh.tensor > 0 and m.num_heads % self.mesh.tensor:
      raise ValueError(f"mesh.tensor={self.mesh.tensor} does not divide model.num_heads={m.num_heads}")
    return self


def _set_dotted(tree: dict, key: str, value):
  parts = key.split(".")
  node = tree
  for part in parts[:-1]:
    child = node.setdefault(part, {})
    if not isinstance(child, dict):
      raise ConfigError(f"override {key}: {part} is a value, not a section")
    node = child
  node[parts[-1]] = value


def parse_overrides(overrides) -> list[tuple[str, object]]:
  """`a.b=3` strings -> (key, YAML-parsed value) pairs."""
  pairs = []
  for item in overrides or ():
    key, sep, raw = item.partition("=")
    if not sep or not key:
      raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. model.num_layers=4)")
    pairs.append((key.strip(), yaml.safe_load(raw) if raw != "" else ""))
  return pairs


def resolve_config_path(path: str | None) -> Path:
  """A file path, or the name of a shipped config (`tiny`, `llama3-8b`)."""
  name = path or "tiny"
  candidate = Path(name)
  if candidate.is_file():
    return candidate
  shipped = importlib.resources.files("jaxpar.configs") / f"{name}.yaml"
  if "/" not in name and shipped.is_file():
    return Path(str(shipped))
  raise ConfigError(f"config {name!r} not found: give a YAML path or one of {sorted(shipped_configs())}")


def shipped_configs() -> list[str]:
  root = importlib.resources.files("jaxpar.configs")
  return [p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml")]


def _describe(error: ValidationError) -> str:
  first = error.errors()[0]
  key = ".".join(str(p) for p in first["loc"])
  msg = first["msg"].removeprefix("Value error, ")
  if first["type"] == "extra_forbidden":
    return f"unknown config key {key!r}: check the spelling (`jaxpar config show` lists valid keys)"
  if not key or isinstance(first.get("input"), dict):
    return msg  # a cross-field check: its message already names the keys
  return f"{key}={first.get('input')!r}: {msg}"


def from_dict(tree: dict) -> Config:
  try:
    return Config.model_validate(tree)
  except ValidationError as e:
    raise ConfigError(_describe(e)) from None


def load_config(path: str | None = None, overrides=()) -> Config:
  """Load a YAML experiment (default: the shipped `tiny`), apply `key=value` overrides."""
  file = resolve_config_path(path)
  try:
    tree = yaml.safe_load(file.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"{file}: not valid YAML ({str(e).splitlines()[0]})") from None
  if not isinstance(tree, dict):
    raise ConfigError(f"{file}: expected a mapping of sections (model, mesh, data, train, checkpoint)")
  for key, value in parse_overrides(overrides):
    _set_dotted(tree, key, value)
  return from_dict(tree)


def replace(config: Config, **sections) -> Config:
  """A new validated config with whole sections or `section={field: value}` updates."""
  tree = config.model_dump()
  for section, updates in sections.items():
    tree[section].update(updates)
  return from_dict(tree)


def checkpoint_dir(config: Config) -> Path:
  return Path(config.checkpoint.dir or Path(config.train.run_dir) / "checkpoints")


def to_yaml(config: Config) -> str:
  return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
