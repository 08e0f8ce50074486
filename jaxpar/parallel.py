"""What each mesh axis does, and every check that an axis can fail, in one place.

The `mesh` section says how many devices each axis has; the `parallel` section holds the
execution choices (how attention crosses the `context` devices, zig-zag load balance,
Megatron sequence parallelism, the pipeline schedule over the `stage` devices). A `ParallelPlan` joins the two once and answers the rest
of jaxpar: the trainer (batch split, zig-zag), the runtime (rules, the attention strategy),
the engine (can it generate on this mesh), `aot/` and the planner (which axes a layout may
use). The model config describes the network only.

Checks run twice: when a config is loaded (axes of known size; `-1` is not known yet) and
when a mesh is built (every size known). Either way the error is one line naming the key.
"""

import dataclasses
import logging
import math
from typing import Literal

import numpy as np
from pydantic import Field

from jaxpar.errors import ConfigError
from jaxpar.mesh import AXES, ExecutionOptions, PipelineOptions
from jaxpar.mesh.rules import sequence_parallel_rules, unused_mesh_axes
from jaxpar.models.config import Frozen
from jaxpar.models.layer_pattern import layer_mixer, unit_options
from jaxpar.models.pipeline import bubble_fraction, stage_major_order

_log = logging.getLogger(__name__)


class ContextParallelConfig(Frozen):
  """With mesh.context > 1: the sequence is split over the context devices."""
  # all_gather: gather keys/values (cheap with few kv heads); ring: pass key/value blocks
  # around the ring (less memory).
  attention: Literal["all_gather", "ring"] = "all_gather"
  # Zig-zag order over the context devices (device i holds chunks i and 2N-1-i), so each
  # does the same causal work; the train step reorders each batch once.
  load_balance: bool = True


class PipelineConfig(Frozen):
  """With mesh.stage > 1: the repeated layers run as stages x repeats groups over the stage
  devices, `microbatches` streaming through (docs/parallelism.md#pipelines)."""
  # gpipe: each stage holds one contiguous block of layers; circular: `repeats` blocks, so a
  # microbatch loops through the stages `repeats` times and the bubble shrinks R-fold.
  schedule: Literal["gpipe", "circular"] = "gpipe"
  microbatches: int | None = Field(None, ge=1)  # per train step (per accumulation step); None: mesh.stage
  repeats: int = Field(1, ge=1)


class ParallelConfig(Frozen):
  """How the mesh's axes run the model (the `parallel` section of a config)."""
  context: ContextParallelConfig = ContextParallelConfig()
  pipeline: PipelineConfig = PipelineConfig()
  # Megatron sequence parallelism: with mesh.tensor > 1, split the residual stream (norms,
  # residual adds) along length over `tensor` too, instead of repeating it on each device.
  sequence_parallel: bool = False


# Keys that configs written before the `parallel` section kept under `model`.
_MOVED = {"context_parallel": ("context", "attention"), "context_load_balance": ("context", "load_balance"),
          "sequence_parallel": ("sequence_parallel",)}


def migrate_model_keys(tree: dict) -> dict:
  """A config tree with the old `model.context_parallel`, `model.context_load_balance` and
  `model.sequence_parallel` moved to their `parallel` keys (one deprecation note each); a
  key set in both places must agree. Saved checkpoints' configs restore through this."""
  model = tree.get("model")
  if not isinstance(model, dict) or not any(k in model for k in _MOVED):
    return tree
  model, parallel = dict(model), _deep_copy(tree.get("parallel") or {})
  for old, path in _MOVED.items():
    if old not in model:
      continue
    value = model.pop(old)
    node = parallel
    for key in path[:-1]:
      node = node.setdefault(key, {})
    new = "parallel." + ".".join(path)
    if path[-1] in node and node[path[-1]] != value:
      raise ConfigError(f"model.{old}={value!r} and {new}={node[path[-1]]!r} disagree: "
                        f"remove model.{old} (it moved to {new})")
    node[path[-1]] = value
    _log.warning("model.%s is deprecated: it moved to %s (set there to %r)", old, new, value)
  return {**tree, "model": model, "parallel": parallel}


def _deep_copy(tree):
  return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in tree.items()}


def parse_mesh_sizes(items, option: str = "mesh") -> dict[str, int]:
  """Command-line mesh sizes, `mesh.tensor=8` or `tensor=8` -> {"tensor": 8} (one syntax for
  every command that takes a mesh)."""
  sizes = {}
  for item in items or ():
    key, _, value = item.partition("=")
    axis = key.removeprefix("mesh.")
    if axis not in AXES or not value.lstrip("-").isdigit():
      raise ConfigError(f"{option} {item!r} is not a mesh size: write mesh.AXIS=SIZE with AXIS one of {list(AXES)}")
    sizes[axis] = int(value)
  return sizes


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
  """Mesh axis sizes (-1: not known yet) with the parallel section."""
  sizes: dict
  config: ParallelConfig = ParallelConfig()

  @classmethod
  def of(cls, mesh, config: ParallelConfig = ParallelConfig()) -> "ParallelPlan":
    """From a jax Mesh (sizes known) or a MeshConfig (sizes as written)."""
    sizes = dict(mesh.shape) if hasattr(mesh, "devices") else mesh.axis_sizes()
    return cls({a: sizes[a] for a in AXES}, config)

  def size(self, axis: str) -> int:
    """The axis size, or 1 while it is not known (-1)."""
    return max(self.sizes[axis], 1)

  # -- what the axes do ----------------------------------------------------------------

  @property
  def splits_sequence(self) -> bool:
    return self.size("context") > 1

  @property
  def load_balance(self) -> bool:
    """Zig-zag order over the context devices (only meaningful when they split the sequence)."""
    return self.config.context.load_balance

  @property
  def sequence_parallel(self) -> bool:
    return self.config.sequence_parallel

  @property
  def pipelined(self) -> bool:
    return self.size("stage") > 1

  @property
  def stages(self) -> int:
    return self.size("stage")

  @property
  def repeats(self) -> int:
    return self.config.pipeline.repeats

  @property
  def microbatches(self) -> int:
    """Pipeline microbatches per step (1 without a pipeline)."""
    if not self.pipelined:
      return 1
    return self.config.pipeline.microbatches or self.stages

  @property
  def bubble_fraction(self) -> float:
    """Each stage's idle share of the pipeline iterations (0 without a pipeline)."""
    return bubble_fraction(self.stages, self.microbatches, self.repeats) if self.pipelined else 0.0

  def describe_pipeline(self) -> str:
    p = self.config.pipeline
    return (f"pipeline: {self.stages} stages, {p.schedule}"
            + (f" x {self.repeats} repeats" if self.repeats > 1 else "")
            + f", {self.microbatches} microbatches: bubble {100 * self.bubble_fraction:.1f}% "
            f"= (S-1)/(M*R+S-1) = {self.stages - 1}/{self.microbatches * self.repeats + self.stages - 1}")

  def layer_order(self, model) -> np.ndarray | None:
    """Stored position -> canonical layer of the pipelined layer group (None: canonical
    order, as without a pipeline or with one repeat). Checkpoints are read in the order of
    the config that wrote them and moved to this one's (saved_run.relayout)."""
    if not self.pipelined or self.repeats == 1:
      return None
    return stage_major_order(model.num_layers - model.first_dense_layers, self.stages, self.repeats)

  @property
  def execution_options(self) -> ExecutionOptions:
    pipeline = None
    if self.pipelined:
      pipeline = PipelineOptions(self.stages, self.microbatches, self.repeats, axis="stage")
    return ExecutionOptions(context_attention=self.config.context.attention, pipeline=pipeline)

  def pipeline_rules(self, rules):
    """The rules of the pipelined layer group: its stacked `layers` axis lives on `stage`,
    and nothing else does."""
    return tuple((name, ("stage",) if name == "layers" else tuple(a for a in axes if a != "stage"))
                 for name, axes in rules)

  def rules(self, rules):
    """The logical rules as this plan runs them: sequence parallelism splits the residual
    stream's length over `tensor` too; a pipeline splits the weights outside its layer
    group (embedding, output projection, dense first layers) over `stage` as one more FSDP
    axis, so every device holds 1/N of the whole model state."""
    rules = sequence_parallel_rules(rules) if self.sequence_parallel else rules
    if self.pipelined:
      rules = tuple((name, axes + ("stage",) if name == "embed" else axes) for name, axes in rules)
    return rules

  def layout_axes(self, model, seq_len: int) -> tuple[str, ...]:
    """The mesh axes a planner may give devices to for this model: data, fsdp and tensor
    always; stage when the layers are stacked (a pipeline runs them); context when attention
    has a split form; expert for mixture-of-experts layers."""
    axes = ["data", "stage", "fsdp", "context", "tensor"]
    if not model.scan_layers or model.num_layers - model.first_dense_layers < 2:
      axes.remove("stage")
    if model.attention == "reference" or seq_len < 2:
      axes.remove("context")
    if getattr(model, "moe", None) is not None and model.mlp == "moe":
      axes.insert(axes.index("fsdp") + 1, "expert")
    return tuple(axes)

  # -- checks --------------------------------------------------------------------------

  def check(self, model, data=None, train=None):
    """Every axis check that the sizes known so far allow (see the module docstring)."""
    self._check_pipeline(model)
    tensor, expert = self.size("tensor"), self.size("expert")
    if tensor > 1 and model.num_heads % tensor:
      raise ConfigError(f"mesh.tensor={tensor} does not divide model.num_heads={model.num_heads}")
    moe = getattr(model, "moe", None)
    if moe is not None and expert > 1 and moe.num_experts % expert:
      raise ConfigError(f"mesh.expert={expert} does not divide model.moe.num_experts="
                        f"{moe.num_experts}: each device must hold a whole number of experts")
    if data is not None:
      self._check_sequence_split(model, data.seq_len)
    if data is not None and train is not None:
      self._check_batch_split(data.global_batch_size, train.microbatches)

  def _check_pipeline(self, model):
    p = self.config.pipeline
    if p.schedule == "gpipe" and p.repeats > 1:
      raise ConfigError(f"parallel.pipeline.repeats={p.repeats} needs parallel.pipeline.schedule=circular "
                        "(gpipe runs each stage's layers once)")
    if p.schedule == "circular" and p.repeats == 1:
      raise ConfigError("parallel.pipeline.schedule=circular needs parallel.pipeline.repeats > 1 "
                        "(with one repeat it is gpipe)")
    if self.sizes["stage"] == -1 and p.repeats > 1:
      raise ConfigError("mesh.stage=-1 with parallel.pipeline.schedule=circular: give the stage count "
                        "(a checkpoint's layer order follows it)")
    if not self.pipelined:
      return
    S, R, M = self.stages, self.repeats, self.microbatches
    if R > 1 and M < S:
      raise ConfigError(f"parallel.pipeline.microbatches={M} is below mesh.stage={S}: a circular schedule "
                        f"needs at least one microbatch per stage in flight; use {S} or more")
    if not model.scan_layers:
      raise ConfigError(f"model.scan_layers=false with mesh.stage={S}: pipeline stages run stacked "
                        "layers; set model.scan_layers=true")
    mixers = {layer_mixer(model, i) for i in range(model.first_dense_layers, model.num_layers)}
    if len(mixers) > 1:
      raise ConfigError(f"model.layer_pattern mixes token mixers ({', '.join(sorted(mixers))}) with mesh.stage={S}: "
                        "pipelining a hybrid stack is not built yet; use mesh.stage=1")
    count = model.num_layers - model.first_dense_layers
    groups = S * R
    what = f"mesh.stage={S} x parallel.pipeline.repeats={R} = {groups}" if R > 1 else f"mesh.stage={S}"
    dense = f" (after model.first_dense_layers={model.first_dense_layers}, which run before the pipeline)" \
        if model.first_dense_layers else ""
    if count % groups:
      near = sorted({max(groups, count // groups * groups), (count // groups + 1) * groups})
      stages = [d for d in range(2, count + 1) if count % (d * R) == 0][:6]
      raise ConfigError(f"model.num_layers={model.num_layers}: {count} pipelined layers{dense} do not split "
                        f"into {what} groups; pipeline {' or '.join(map(str, near))} layers, or use "
                        f"mesh.stage in {stages or [1]}")
    period = len(unit_options(model, model.first_dense_layers, count))
    if (count // groups) % period:
      raise ConfigError(f"{what} gives each stage {count // groups} layers per repeat, not a whole "
                        f"number of model.layer_pattern's {period}-layer units: every stage must run the "
                        "same per-layer options; change the stage or repeat count")

  def _check_sequence_split(self, model, seq_len: int):
    """seq_len must split evenly where the mesh splits it, and attention must have a form
    that runs split."""
    context, tensor = self.size("context"), self.size("tensor")
    if context > 1 and model.attention == "reference":
      raise ConfigError(f"model.attention='reference' with mesh.context={context}: the reference "
                        "materialises whole score matrices and has no context-parallel form; use "
                        "auto, chunked or flash")
    if context > 1:
      multiple = 2 * context if self.load_balance else context
      if seq_len % multiple:
        why = " (zig-zag load balancing: 2 chunks per device)" if self.load_balance else ""
        raise ConfigError(f"data.seq_len={seq_len} must be a multiple of {multiple} to split over "
                          f"mesh.context={context}{why}")
    if model.mlp_chunks > 1 and seq_len % (context * model.mlp_chunks):
      raise ConfigError(f"model.mlp_chunks={model.mlp_chunks} does not divide each device's "
                        f"{seq_len // context} positions (data.seq_len={seq_len} over "
                        f"mesh.context={context}): use a divisor of that")
    if self.sequence_parallel and tensor > 1 and seq_len % (context * tensor):
      raise ConfigError(f"data.seq_len={seq_len} must be a multiple of mesh.context x mesh.tensor "
                        f"= {context * tensor} for parallel.sequence_parallel")

  def _check_batch_split(self, global_batch: int, microbatches: int, rules=None):
    if global_batch % microbatches:
      raise ConfigError(f"train.microbatches={microbatches} must divide "
                        f"data.global_batch_size={global_batch}")
    stream = self.microbatches
    if (global_batch // microbatches) % stream:
      raise ConfigError(f"parallel.pipeline.microbatches={stream} must divide the {global_batch // microbatches} "
                        f"rows of each step (data.global_batch_size={global_batch} / train.microbatches="
                        f"{microbatches})")
    if rules is None or any(s < 1 for s in self.sizes.values()):
      return
    shards = math.prod(self.sizes[a] for a in dict(rules).get("batch", ()))
    if (global_batch // microbatches // stream) % shards:
      piped = f" / parallel.pipeline.microbatches={stream}" if stream > 1 else ""
      raise ConfigError(f"data.global_batch_size={global_batch} (/ train.microbatches={microbatches}{piped}) "
                        f"must divide over the {shards} batch shards of the mesh")

  def check_training(self, model, data, train, rules):
    """Before a train step is built: everything, with the rules the runtime resolved."""
    self.check(model, data, train)
    self._check_batch_split(data.global_batch_size, train.microbatches, rules)

  @staticmethod
  def used_axes(rules) -> set[str]:
    """The mesh axes that hold something under `rules`: those the rules name, and `stage`,
    which the pipeline uses whatever the rules say."""
    return {axis for _, axes in rules for axis in axes} | {"stage"}

  def check_rules(self, rules, rules_name):
    """Every mesh axis with devices must be used by some rule, else its devices repeat work."""
    unused = [a for a in unused_mesh_axes(rules, self.sizes) if a not in self.used_axes(())]
    if unused:
      raise ConfigError(f"mesh.{unused[0]}={self.sizes[unused[0]]} but mesh.rules={rules_name!r} "
                        "never uses that axis: pick rules that do (e.g. fsdp_tp) or set it to 1")

  def check_platform(self, model, platform: str):
    """What the backend cannot run split: the flash kernel in interpret mode (CPU) cannot
    take per-device offsets inside shard_map."""
    if self.splits_sequence and model.attention == "flash" and platform not in ("tpu", "gpu"):
      raise ConfigError(f"model.attention='flash' runs in interpret mode on {platform}, which JAX "
                        "cannot run with per-device offsets inside shard_map: use 'chunked' or "
                        "'auto' when mesh.context > 1")

  def check_generation(self):
    """Generation decodes whole sequences per device, through every layer in order."""
    if self.splits_sequence:
      raise ConfigError(f"mesh.context={self.sizes['context']}: generation does not split sequences "
                        "over devices; use mesh.context=1 (tensor or data parallelism instead)")
    if self.pipelined:
      raise ConfigError(f"mesh.stage={self.sizes['stage']}: generation does not run pipeline stages; "
                        "use mesh.stage=1 (the weights restore onto any mesh)")

  def generation_sizes(self) -> dict:
    """These devices laid out for generation: the context and stage devices fold into fsdp."""
    sizes = dict(self.sizes)
    for axis in ("context", "stage"):
      if self.size(axis) > 1:
        sizes["fsdp"], sizes[axis] = self.size("fsdp") * sizes[axis], 1
    return sizes
