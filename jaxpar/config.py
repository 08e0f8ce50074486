"""One frozen, validated experiment config: YAML file + dotted command-line overrides.

Every error is one line that names the key, the bad value and what would be valid.
"""

import importlib.resources
import itertools
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field, SerializeAsAny, ValidationError, field_validator, model_validator

from jaxpar.errors import ConfigError, did_you_mean
from jaxpar.data.sources import BUNDLED_FILES, is_glob, set_name
from jaxpar.mesh.build import AXES as MESH_AXES
from jaxpar.models import check_blocks, get_family
from jaxpar.models.config import Frozen as _Frozen
from jaxpar.models.config import ModelConfig, RopeScaling  # noqa: F401  (the model section)
from jaxpar.objectives import Options, get_objective, migrate_objective_keys
from jaxpar.parallel import ParallelConfig, ParallelPlan, migrate_model_keys


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
  # A preset name or explicit [logical, mesh axes] pairs; None: the model family's preset.
  rules: str | list[tuple[str, str | list[str] | None]] | None = None
  topology: str | None = None  # the TPU slice this config is sized for, e.g. v6e-256
  # XLA/libtpu compiler options: `default` (the chip generation's preset, jaxpar/cluster/xla_flags.py),
  # `none`, or a list of `xla_name=value` flags.
  xla_flags: Literal["default", "none"] | tuple[str, ...] = "default"

  @field_validator("xla_flags", mode="before")
  @classmethod
  def _flags(cls, value):
    if isinstance(value, str):
      if value not in ("default", "none"):
        raise ValueError("use default, none, or a list of xla_name=value flags")
      return value
    bad = [f for f in value if not str(f).removeprefix("--").startswith("xla_") or "=" not in str(f)]
    if bad:
      raise ValueError(f"{bad[0]!r} is not a flag: write xla_name=value")
    return value

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


class SourceConfig(_Frozen):
  """One named data source of a mixture (jaxpar/data/sources.py says what a path may be)."""
  path: str  # 'bundled', a file, a folder, a glob of shards, a `datasets` folder or a token cache
  weight: float = Field(1.0, ge=0)  # its share of training samples; 0: never trained on (eval only)
  holdout: float = Field(0.0, ge=0, lt=1)  # fraction of its documents kept out of training, for eval
  text_key: str | None = None  # default: data.text_key
  tokens_key: str | None = None  # a column of token-id lists instead of text; default: data.tokens_key


SINGLE_SOURCE = "heldout"  # the name `data.source` goes by (its held-out documents' eval set)


def _check_path(key: str, path: str):
  if path not in BUNDLED_FILES and not is_glob(path) and not Path(path).expanduser().exists():
    raise ValueError(f"{key}={path!r} does not exist: give 'bundled', a data file (.txt, .jsonl, "
                     ".parquet, .arrow, .feather), a folder or glob of them, or a token cache")


class DataConfig(_Frozen):
  source: str = "bundled"
  # Named sources mixed by weight, instead of `source`: {name: {path, weight, holdout, ...}}.
  sources: dict[str, SourceConfig] = {}
  holdout: float = Field(0.0, ge=0, lt=1)  # `source`: fraction of documents kept out of training
  text_key: str = "text"
  tokens_key: str | None = None  # pre-tokenized: the column of token-id lists
  tokenizer: str = "byte"
  # chat: fine-tuning rows (`messages`, or `prompt` + `completion`) in JSON lines, packed with
  # loss on the assistant's tokens only (jaxpar/data/chat_batches.py); preference: DPO pairs
  # (`prompt`, `chosen`, `rejected`: jaxpar/data/preference_batches.py); prompts: reinforcement
  # learning's (`prompt`, `answer`, ...: jaxpar/rl/rollouts.py); text: plain documents.
  format: Literal["text", "chat", "preference", "prompts"] = "text"
  chat_template: str | None = None  # a .jinja file, or chatml (bundled); default: the tokenizer's own
  seq_len: int = 128
  global_batch_size: int = 16
  shuffle_seed: int = 0

  def named_sources(self) -> dict[str, SourceConfig]:
    """Every source by name, its keys filled in (`source` alone is one named 'heldout')."""
    sources = self.sources or {SINGLE_SOURCE: SourceConfig(path=self.source, holdout=self.holdout)}
    return {name: s.model_copy(update={"text_key": s.text_key or self.text_key,
                                       "tokens_key": s.tokens_key or self.tokens_key})
            for name, s in sources.items()}

  @model_validator(mode="after")
  def _valid(self, info):
    # Compared with the defaults, not the keys given: a saved config (model_dump) holds every key.
    if self.sources and (self.source != "bundled" or self.holdout):
      raise ValueError("data.sources replaces data.source and data.holdout: give a path and holdout "
                       "per source, or use data.source alone")
    if self.sources and not any(s.weight > 0 for s in self.sources.values()):
      raise ValueError("data.sources: every weight is 0, so nothing is trained on: give at least one "
                       "source a positive weight")
    if self.format != "text" and self.sources:
      raise ValueError(f"data.format={self.format} reads the rows of one data.source, not data.sources")
    if (info.context or {}).get("check_paths", True) is False:
      return self  # a saved run's config: the weights carry their tokenizer
    if self.chat_template not in (None, "chatml") and not Path(self.chat_template).is_file():
      raise ValueError(f"data.chat_template={self.chat_template!r} does not exist: give a .jinja file")
    for name, s in self.sources.items():
      _check_path(f"data.sources.{name}.path", s.path)
    if not self.sources:
      _check_path("data.source", self.source)
    if self.tokenizer != "byte" and not Path(self.tokenizer).exists():
      raise ValueError(f"data.tokenizer={self.tokenizer!r} does not exist: give the path of a "
                       "Hugging Face tokenizer.json, or 'byte'")
    return self


class EvalConfig(_Frozen):
  """Loss, perplexity and bits per byte on held-out text (jaxpar/train/evaluator.py)."""
  every_steps: int = Field(0, ge=0)  # evaluate after every N training steps and at the end; 0: never
  steps: int | None = Field(None, ge=1)  # batches per evaluation; None: the whole set
  batch_size: int | None = Field(None, ge=1)  # windows per batch; default data.global_batch_size
  # What to evaluate, by name: a data source's held-out documents (holdout > 0), a weight-0
  # source whole, or a path (named by its file name). Default: every such source.
  sets: list[str] | None = None


# Per train.sync: (outer learning rate, outer momentum, mixing, overlap, bits) unless train.diloco
# sets them. SparseLoCo's error feedback already carries past steps: its outer step is a plain
# average (benchmarks/low_bandwidth.py measured Nesterov 0.9 on top of it worse).
_SYNC_DEFAULTS = {"diloco": (0.7, 0.9, 0.0, 0, 32), "streaming_diloco": (0.7, 0.9, 0.5, 1, 4),
                  "sparseloco": (1.0, 0.0, 0.0, 0, 2)}


class DilocoConfig(_Frozen):
  """How data-parallel replicas agree when train.sync is not allreduce
  (jaxpar/train/replicas/ says what each key does); None: the method's default."""
  every: int = Field(16, ge=1)  # H: inner steps between two syncs of a fragment
  fragments: int = Field(1, ge=1)  # streaming_diloco: the layers in this many fragments, synced in turn
  outer_learning_rate: float | None = Field(None, gt=0)  # diloco and streaming 0.7, sparseloco 1
  outer_momentum: float | None = Field(None, ge=0, lt=1)  # Nesterov: diloco and streaming 0.9, sparseloco 0
  mixing: float | None = Field(None, ge=0, lt=1)  # alpha: the replica's share after a sync (diloco 0, streaming 0.5)
  overlap: Literal[0, 1] | None = None  # steps a sync's exchange overlaps (diloco 0, streaming 1)
  bits: Literal[32, 16, 8, 4, 2] | None = None  # pseudo-gradient values on the wire (diloco 32, streaming 4, sparseloco 2)
  density: float = Field(1 / 32, gt=0, le=1)  # sparseloco: the share of each chunk sent
  chunk: int = Field(128, ge=8, le=65536)  # values per quantization scale (and per top-k)
  error_decay: float = Field(0.95, ge=0, le=1)  # sparseloco: the error-feedback buffer's decay

  def resolved(self, sync: str) -> "DilocoConfig":
    """These settings with the method's defaults filled in."""
    keys = ("outer_learning_rate", "outer_momentum", "mixing", "overlap", "bits")
    return self.model_copy(update={key: default if getattr(self, key) is None else getattr(self, key)
                                   for key, default in zip(keys, _SYNC_DEFAULTS[sync])})

  def check(self, sync: str):
    """One line for settings the method cannot use."""
    if sync == "allreduce":
      return
    s = self.resolved(sync)
    if s.fragments > 1 and sync != "streaming_diloco":
      raise ValueError(f"train.diloco.fragments={s.fragments} splits the layers for train.sync=streaming_diloco; "
                       f"train.sync={sync} syncs them all at once: set fragments=1 or sync=streaming_diloco")
    if s.every % s.fragments:
      raise ValueError(f"train.diloco.every={s.every} is not a multiple of train.diloco.fragments={s.fragments}: "
                       "the fragments' syncs are staggered every/fragments steps apart")
    if s.chunk % 8 or s.chunk * s.bits % 8:
      raise ValueError(f"train.diloco.chunk={s.chunk} must be a multiple of 8 (its codes fill whole bytes)")
    if sync == "sparseloco":
      kept = round(s.density * s.chunk)
      if kept < 1 or kept * s.bits % 8:
        raise ValueError(f"train.diloco.density={s.density} keeps {kept} of each {s.chunk}-value chunk at {s.bits} "
                         f"bits: pick density x chunk x bits as a positive multiple of 8 (e.g. density={8 / s.chunk / s.bits:g})")
      if s.bits > 8:
        raise ValueError(f"train.diloco.bits={s.bits} with train.sync=sparseloco: its values go 8, 4 or 2 bits each")


class GaloreConfig(_Frozen):
  """train.optimizer: galore (jaxpar/train/galore.py): Adam in a low-rank projection of each
  hidden matrix's gradient."""
  rank: int = Field(128, ge=1)  # the projection's rank (at most the matrix's smaller side)
  update_every: int = Field(200, ge=1)  # steps between two refreshes of the projection (an SVD)
  scale: float = Field(0.25, gt=0)  # alpha: the projected matrices' updates are scaled by it


class TrainConfig(_Frozen):
  steps: int = 300
  # jaxpar/train/optim.py says what each optimizer and schedule does with these keys.
  optimizer: Literal["adamw", "adafactor", "lion", "sgd", "muon", "galore"] = "adamw"
  schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
  learning_rate: float = Field(3e-3, gt=0)
  warmup_steps: int = 20
  min_lr_ratio: float = 0.1
  decay_fraction: float = Field(0.2, gt=0, le=1)  # wsd: the last fraction of the steps decays
  weight_decay: float = 0.1
  b1: float = 0.9  # adamw, lion, muon's AdamW part
  b2: float = 0.95
  eps: float = 1e-8
  momentum: float | None = Field(None, ge=0, lt=1)  # sgd (default 0.9), muon (default 0.95)
  galore: GaloreConfig = GaloreConfig()
  grad_clip: float | None = 1.0
  # How the optimizer's parameter-shaped moments are stored between steps (jaxpar/train/moments.py):
  # float32 (8 bytes per parameter for AdamW), bfloat16 (4) or int8_blockwise (about 2).
  optimizer_state_dtype: Literal["float32", "bfloat16", "int8_blockwise"] = "float32"
  # Where the optimizer state lives and updates (jaxpar/train/offload.py): on the device, or in
  # pinned host memory with the update run by the host (ZeRO-Offload), off the device's peak.
  offload_optimizer: Literal["none", "host"] = "none"
  z_loss: float = 0.0
  # How the `data` replicas agree (jaxpar/train/replicas/): allreduce (the gradients, every step),
  # diloco, streaming_diloco, sparseloco (local steps, then a sync of the parameters' drift: train.diloco).
  sync: Literal["allreduce", "diloco", "streaming_diloco", "sparseloco"] = "allreduce"
  diloco: DilocoConfig = DilocoConfig()
  # A registered objective (jaxpar/objectives/): lm (text), sft (chat rows), dpo (preference
  # pairs), grpo (prompts, reinforcement learning); its own keys are the config's `objective:` section.
  objective: str = "lm"
  microbatches: int = 1
  # Sequence positions per device in each chunk of the fused output-projection + loss
  # (0: plain logits); under context parallelism a chunk spans the context devices.
  logits_chunk_len: int = 128
  seed: int = 0
  log_every: int = 10
  run_dir: str = "runs/default"
  # Where the metrics go besides metrics.jsonl (jaxpar/train/trackers.py); wandb and mlflow
  # are extras: pip install 'jaxpar[wandb]', 'jaxpar[mlflow]'.
  loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]
  peak_flops_per_device: float | None = None
  # The sample printed at the end of `jaxpar train` (0 tokens: none), drawn with these settings.
  sample_prompt: str = "The "
  sample_tokens: int = 64
  sample_temperature: float = Field(0.8, ge=0)
  sample_top_p: float = Field(0.95, gt=0, le=1)

  @model_validator(mode="after")
  def _narrow_moments(self):
    if self.optimizer_state_dtype != "float32" and self.optimizer in ("adafactor", "muon", "galore"):
      raise ValueError(f"train.optimizer_state_dtype={self.optimizer_state_dtype} stores AdamW's, Lion's and "
                       f"SGD's moments; {self.optimizer}'s keep float32: set train.optimizer_state_dtype=float32 "
                       "or another train.optimizer")
    self.diloco.check(self.sync)
    if self.offload_optimizer != "none" and self.sync != "allreduce":
      raise ValueError(f"train.offload_optimizer={self.offload_optimizer} keeps the one optimizer state in host "
                       f"memory; train.sync={self.sync} keeps a state per replica beside its parameters: set "
                       "train.offload_optimizer=none or train.sync=allreduce")
    if self.offload_optimizer != "none" and self.optimizer_state_dtype != "float32":
      raise ValueError(f"train.offload_optimizer={self.offload_optimizer} keeps float32 moments in host memory, "
                       "where room is plenty; narrower moments are for the device: set "
                       "train.optimizer_state_dtype=float32 or train.offload_optimizer=none")
    return self

  @field_validator("loggers")
  @classmethod
  def _once_each(cls, loggers):
    twice = sorted({name for name in loggers if loggers.count(name) > 1})
    if twice:
      raise ValueError(f"{', '.join(twice)} listed more than once: list each logger once")
    return loggers


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
  model: SerializeAsAny[ModelConfig] = ModelConfig()  # the family's own ModelConfig subclass
  mesh: MeshConfig = MeshConfig()
  parallel: ParallelConfig = ParallelConfig()
  data: DataConfig = DataConfig()
  train: TrainConfig = TrainConfig()
  eval: EvalConfig = EvalConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  objective: SerializeAsAny[Options] = Options()  # train.objective's own Options subclass

  @model_validator(mode="after")
  def _consistent(self, info):
    m, d = self.model, self.data
    if type(self.objective) is not get_objective(self.train.objective).Options:
      raise ValueError(f"the objective section holds {type(self.objective).__name__}, not train.objective="
                       f"{self.train.objective}'s options: build configs with from_dict")
    if d.seq_len > m.max_seq_len:
      raise ValueError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}: "
                       "lower data.seq_len or raise model.max_seq_len")
    check_blocks(m)
    if m.mlp == "moe" and getattr(m, "moe", None) is None:
      raise ValueError(f"model.mlp='moe' needs a model.moe section, which model.family={m.family!r} "
                       "does not have: use a mixture-of-experts family (mixtral, qwen3_moe, deepseek)")
    self.plan().check(m, d, self.train)
    sets = self.eval_sets()
    if self.eval.every_steps and not sets:
      raise ValueError(f"eval.every_steps={self.eval.every_steps} but there is nothing to evaluate: "
                       "set data.holdout (or a source's holdout), add a weight-0 source, or list eval.sets")
    if (info.context or {}).get("check_paths", True):
      for path in set(sets.values()) - set(d.named_sources()):
        _check_path("eval.sets", path)
    return self

  def eval_sets(self) -> dict[str, str]:
    """The eval sets by name -> a data source's name or a path (see EvalConfig.sets)."""
    sources = self.data.named_sources()
    if self.eval.sets is None:
      return {name: name for name, s in sources.items() if s.holdout > 0 or s.weight == 0}
    sets = {}
    for entry in self.eval.sets:
      source = sources.get(entry)
      if source is not None and source.weight > 0 and not source.holdout:
        raise ValueError(f"eval.sets: {entry!r} is trained on and holds no documents out: set its "
                         "holdout (data.holdout, or data.sources.NAME.holdout), or give its weight 0")
      sets[entry if source is not None else set_name(entry)] = entry
    return sets

  def plan(self, mesh=None) -> ParallelPlan:
    """What each mesh axis does: on `mesh` (a jax Mesh) when given, else as the sizes are written."""
    return ParallelPlan.of(mesh if mesh is not None else self.mesh, self.parallel)


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


def _keys(cls: type[BaseModel], prefix: str = "") -> list[str]:
  """Every dotted key of a config section class."""
  keys = []
  for name, field in cls.model_fields.items():
    keys.append(prefix + name)
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
      keys += _keys(field.annotation, f"{prefix}{name}.")
  return keys


def config_summary(name: str, width: int = 100) -> str:
  """The first sentence of a shipped config's opening comment, cut to `width` at a word."""
  text = importlib.resources.files("jaxpar.configs").joinpath(f"{name}.yaml").read_text()
  comment = " ".join(line.lstrip("# ").strip() for line in itertools.takewhile(lambda l: l.startswith("#"), text.splitlines()))
  sentence = re.split(r"(?<=\.)\s", comment, maxsplit=1)[0].rstrip(".")
  return sentence if len(sentence) <= width else sentence[:width].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def _describe(error: ValidationError, section: str = "", cls: type[BaseModel] | None = None) -> str:
  first = error.errors()[0]
  key = ".".join((section,) * bool(section) + tuple(str(p) for p in first["loc"]))
  msg = first["msg"].removeprefix("Value error, ")
  if first["type"] == "extra_forbidden":
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in _keys(cls or Config, f"{section}." if section else "")
                if k.rpartition(".")[0] == parent]
    hint = did_you_mean(leaf, siblings, f"{parent}." if parent else "") or ": check the spelling"
    return f"unknown config key {key!r}{hint} (`jaxpar config show` lists valid keys)"
  if not key or isinstance(first.get("input"), dict):
    return msg  # a cross-field check: its message already names the keys
  return f"{key}={first.get('input')!r}: {msg}"


def model_from_dict(model: dict) -> ModelConfig:
  """The `model` section, validated by its family's config class (a family may add fields)."""
  try:
    family = get_family(model.get("family", ModelConfig.model_fields["family"].default))
    return family.config.model_validate(model)
  except ValidationError as e:
    raise ConfigError(_describe(e, "model", family.config)) from None
  except ValueError as e:
    raise ConfigError(str(e)) from None


def objective_from_dict(name: str, options: dict) -> Options:
  """The `objective` section, validated by train.objective's own Options class."""
  try:
    cls = get_objective(name).Options
    return cls.model_validate(options)
  except ValidationError as e:
    raise ConfigError(_describe(e, "objective", cls)) from None


def from_dict(tree: dict, *, check_paths: bool = True) -> Config:
  """Validate a config tree; `mesh.rules` defaults to the model family's preset. Keys that
  moved (parallel.py: `migrate_model_keys`) are accepted at their old place with a note.
  check_paths=False: data paths need not exist here (a saved run opened on another machine)."""
  tree = migrate_objective_keys(migrate_model_keys(dict(tree)))
  model = tree.get("model") or {}
  if not isinstance(model, ModelConfig):
    model = model_from_dict(model)
  objective = tree.get("objective") or {}
  if not isinstance(objective, Options):
    objective = objective_from_dict((tree.get("train") or {}).get("objective", "lm"), objective)
  mesh = dict(tree.get("mesh") or {})
  if mesh.get("rules") is None:
    mesh["rules"] = get_family(model.family).rules
  try:
    return Config.model_validate({**tree, "model": model, "mesh": mesh, "objective": objective},
                                 context={"check_paths": check_paths})
  except ValidationError as e:
    raise ConfigError(_describe(e)) from None


def load_config_args(args: list[str]) -> Config:
  """A command line's `[CONFIG] [key=value ...]`: the config named first (if any) with the overrides."""
  path = args[0] if args and "=" not in args[0] else None
  return load_config(path, args[1 if path else 0:])


def load_config(path: str | None = None, overrides=()) -> Config:
  """Load a YAML experiment (default: the shipped `tiny`), apply `key=value` overrides."""
  file = resolve_config_path(path)
  try:
    tree = yaml.safe_load(file.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"{file}: not valid YAML ({str(e).splitlines()[0]})") from None
  if not isinstance(tree, dict):
    raise ConfigError(f"{file}: expected a mapping of sections (model, mesh, parallel, data, train, eval, checkpoint)")
  for key, value in parse_overrides(overrides):
    _set_dotted(tree, key, value)
  return from_dict(tree)


def replace(config: Config, **sections) -> Config:
  """A new validated config with whole sections or `section={field: value}` updates."""
  tree = config.model_dump()
  for section, updates in sections.items():
    tree[section].update(updates)
  # Data paths are checked again only when the data section changes: a saved run's config
  # (check_paths=False) stays usable elsewhere.
  return from_dict(tree, check_paths=bool({"data", "eval"} & set(sections)))


def checkpoint_dir(config: Config) -> Path:
  return Path(config.checkpoint.dir or Path(config.train.run_dir) / "checkpoints")


def to_yaml(config: Config) -> str:
  return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
