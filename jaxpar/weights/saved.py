"""The one door to a saved run: open it once, then generate, evaluate, export or fine-tune.

    run = jaxpar.open_run("runs/tiny")            # a run dir, its checkpoints/ dir, or one step dir
    print(run.step, run.config.model.num_layers)
    logits, _ = run.model(tokens)                 # the NNX module with the saved weights
    engine = Engine.from_run(run, slots=4)        # jaxpar.inference: generation with its tokenizer

The path is resolved, Orbax opened (read only) and the step chosen once; the saved config is
validated (keys that moved since are migrated) and the tokenizer found beside the weights.
`load` restores the weights onto the mesh asked for, each device reading only its shards.
Training resumes, fine-tuning reads its base, inference and export open weights: all here,
and this layer imports none of them.
"""

from pathlib import Path

import jax

from jaxpar.checkpoint import TOKENIZER_DIR, Checkpointer
from jaxpar.config import MeshConfig, from_dict
from jaxpar.data import load_tokenizer
from jaxpar.errors import CheckpointError
from jaxpar.weights.frozen import same_network, split_weights
from jaxpar.weights.quantize import quantize_params
from jaxpar.trees import join
from jaxpar.models.pipeline import reorder_layers, same_order
from jaxpar.models.transformer import PIPELINED_GROUP
from jaxpar.runtime import Runtime


def saved_layer_order(config):
  """The pipelined layer group's order in a checkpoint written with `config` (plan.layer_order)."""
  return config.plan().layer_order(config.model)


def relayout(tree, source, target, shardings=None):
  """`tree` (params, optimizer state, model state, or a tuple/dict of them) with the
  pipelined layer group moved from `source` layer order to `target` (`plan.layer_order`:
  a circular pipeline stores its layers stage-major; None is canonical), in one jitted
  gather placed on `shardings` (default: where each array is). Every path from one layout
  to another (restoring a checkpoint, resuming a run, generating after training) goes
  through here, so a run written with any stage count opens with any other."""
  if same_order(source, target):
    return tree if shardings is None else jax.device_put(tree, shardings)
  shardings = shardings or jax.tree.map(lambda x: x.sharding, tree)
  return jax.jit(lambda t: reorder_layers(t, PIPELINED_GROUP, source, target), out_shardings=shardings)(tree)


def resolve_run(path) -> tuple[Path, int | None]:
  """A run dir (holding checkpoints/), a checkpoint dir (its latest step) or one step dir
  in it -> (checkpoint dir, step or None)."""
  path = Path(path)
  if not path.exists():
    raise CheckpointError(f"checkpoint path {path} does not exist: give a run directory (runs/NAME), "
                          "its checkpoints/ directory, or one step directory in it")
  if path.name.isdigit() and (path / "_CHECKPOINT_METADATA").exists():
    return path.parent, int(path.name)
  if (path / "checkpoints").is_dir() and not any(p.name.isdigit() for p in path.iterdir()):
    return path / "checkpoints", None
  return path, None


def run_name(path) -> str:
  """A saved run's name: its run directory's (runs/tiny, runs/tiny/checkpoints or a step in
  it -> "tiny"), or the checkpoint directory's where no run directory holds it (a converted
  model's)."""
  directory = resolve_run(path)[0].resolve()
  return directory.parent.name if directory.name == "checkpoints" else directory.name


class SavedRun:
  """A saved run, opened once (use `open_run` to open and load it).

  directory, step: the checkpoint directory and the step opened; config: the validated
  config it was saved with; tokenizer: the one it was trained or imported with.
  After `load`: runtime (model config on a mesh), params and model_state (sharded arrays).
  """

  def __init__(self, path, step: int | None = None):
    self.directory, found = resolve_run(path)
    self._checkpoints = Checkpointer(self.directory, read_only=True)
    self.step = self._checkpoints.pick_step(step if step is not None else found)
    saved = self._checkpoints.saved_config(self.step)
    if not saved:
      raise CheckpointError(f"checkpoint {self.path} has no saved config: it was not written by jaxpar")
    self.config = from_dict(saved, check_paths=False)
    self._tokenizer = None
    self.runtime = self.params = self.model_state = None

  @property
  def path(self) -> Path:
    """The step directory opened."""
    return self._checkpoints.path(self.step)

  @property
  def has_optimizer_state(self) -> bool:
    return (self.path / "opt_state").is_dir()

  @property
  def lacks_tokenizer(self) -> bool:
    """An imported model saved without its tokenizer (step 0, parameters only, no tokenizer
    files, the config's default `byte`): the byte tokenizer would turn its ids into garbage."""
    return (self.step == 0 and not self.has_optimizer_state and self.config.data.tokenizer == "byte"
            and not (self.directory / TOKENIZER_DIR / "tokenizer.json").is_file())

  @property
  def tokenizer(self):
    """The checkpoint's own tokenizer files, else the one its config trained with."""
    if self._tokenizer is None:
      if self.lacks_tokenizer:
        raise CheckpointError(
            f"checkpoint {self.directory} was imported without a tokenizer, and jaxpar's byte tokenizer "
            "would make its text garbage: convert again with `jaxpar convert hf-to-jaxpar HF_DIR OUT "
            f"--tokenizer PATH`, or copy the model's tokenizer.json into {self.directory / TOKENIZER_DIR}/")
      bundled = self.directory / TOKENIZER_DIR
      spec = str(bundled) if (bundled / "tokenizer.json").is_file() else self.config.data.tokenizer
      try:
        self._tokenizer = load_tokenizer(spec)
      except ValueError:
        raise CheckpointError(f"checkpoint {self.directory} has no {TOKENIZER_DIR}/tokenizer.json and "
                              f"its config's tokenizer {spec!r} is not there any more: pass a tokenizer") from None
    return self._tokenizer

  def load(self, mesh=None, devices=None) -> "SavedRun":
    """Restore the weights onto `mesh`: a MeshConfig, a dict of axis sizes, or None (FSDP over
    every device: each holds 1/N of the weights, so whatever fits the devices together opens)."""
    if not isinstance(mesh, MeshConfig):
      mesh = MeshConfig(**(mesh or {"fsdp": -1}))
    self.runtime = Runtime(self.config.model, mesh, devices, seed=self.config.train.seed,
                           parallel=self.config.parallel)
    if self.config.model.frozen_base is None:
      saved = self.runtime.restore(self._checkpoints, self.step)
    else:  # adapters or draft heads here, the base weights where model.lora/medusa.base says
      saved = (join(self.read_adapters(self.runtime), load_base(self.runtime)), self.read_model_state(self.runtime))
    self.params, self.model_state = relayout(saved, self.layer_order, self.runtime.layer_order())
    return self

  def read_adapters(self, runtime) -> dict:
    """An adapter (or draft-head) checkpoint's trained weights alone, placed on `runtime` (one
    with its model.lora or model.medusa)."""
    targets = split_weights(runtime, runtime.abstract_targets()[0])[0]
    return self._checkpoints.restore_item("params", targets, self.step)

  def read_model_state(self, runtime) -> dict:
    """The saved model state (router biases, draft heads' base fingerprint), placed on `runtime`."""
    return self._checkpoints.restore_item("model_state", runtime.abstract_targets()[1], self.step)

  def read_params(self, targets: dict) -> dict:
    """The saved parameters, placed per `targets` (sharded ShapeDtypeStructs of every one)."""
    return self._checkpoints.restore_item("params", targets, self.step)

  @property
  def layer_order(self):
    """The pipelined layer group's order as saved."""
    return saved_layer_order(self.config)

  @property
  def model(self):
    """The NNX module holding the restored weights (after `load`)."""
    if self.runtime is None:
      raise CheckpointError("this saved run is not loaded yet: call .load(mesh) or use jaxpar.open_run")
    return self.runtime.merge(self.params, self.model_state)

  def restore_train_state(self, runtime, abstract_state: dict) -> tuple[dict, dict]:
    """(train state items placed per `abstract_state`'s shardings, in `runtime`'s layer order,
    data iterator state): to continue training from this step, on any mesh (a params-only
    checkpoint gives opt_state None). Every resume goes through here: a run's own, `--restore`."""
    quantization = self.config.model.quantization
    if quantization is not None:
      raise CheckpointError(f"checkpoint {self.path} is quantized (model.quantization.mode={quantization.mode}): "
                            "quantized weights are for inference; train from the float checkpoint it was "
                            "quantized from")
    if runtime.adapter_mask is not None and self.config.model.frozen_base is None:
      section = runtime.model_config.frozen_base[0]
      raise CheckpointError(f"--restore {self.directory}: that checkpoint is a whole model; to train "
                            f"{section} over it, set {section}.base={self.directory} instead")
    items, data_state = self._checkpoints.restore(abstract_state, self.step)
    return relayout(items, self.layer_order, runtime.layer_order()), data_state

  def stored_shapes(self, item: str) -> dict[str, tuple]:
    """{leaf name: shape} of this step's `item` (params, opt_state), from metadata alone."""
    return self._checkpoints.stored_shapes(self.step, item) if (self.path / item).is_dir() else {}

  def close(self):
    self._checkpoints.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def open_run(path, mesh=None, step: int | None = None, *, devices=None) -> SavedRun:
  """Open a saved run and restore its weights onto `mesh` (see `SavedRun.load`); `step`
  defaults to the latest complete one."""
  return SavedRun(path, step).load(mesh, devices)


def load_base(runtime) -> dict:
  """The base weights under adapters or draft heads (model.lora.base or model.medusa.base: a
  checkpoint; None: the model's init from its seed, which tests and benchmarks use), placed on
  the runtime's shardings. The trainer and `SavedRun.load` both get the base from here."""
  _, shardings = split_weights(runtime, runtime.param_shardings)
  section, path = runtime.model_config.frozen_base
  if path is None:
    with runtime.context():
      return jax.jit(lambda: split_weights(runtime, runtime.create()[0])[1], out_shardings=shardings)()
  with SavedRun(path) as source:
    if source.config.model.frozen_base is not None:
      raise CheckpointError(f"{section}.base={path} holds adapters or draft heads itself: point {section}.base "
                            f"at a whole model (merge adapters first: `jaxpar lora merge {path} OUT`)")
    ours = runtime.model_config
    if ours.quantization is not None and source.config.model.quantization is None:
      return _quantized_base(runtime, source, shardings)  # QLoRA over a float checkpoint
    if not same_network(ours, source.config.model):
      raise CheckpointError(f"{section}.base={path} was saved with a different model section: copy its "
                            f"model section ({source.path}/config) into this config and add `{section[6:]}:` to it")
    _, targets = split_weights(runtime, runtime.abstract_targets()[0])
    return source.read_params(targets)


def _quantized_base(runtime, source, shardings) -> dict:
  """A float base checkpoint, read and quantized as model.quantization says (QLoRA)."""
  plain = runtime.model_config.model_copy(update={"lora": None, "quantization": None})
  if not same_network(plain, source.config.model.model_copy(update={"quantization": None})):
    raise CheckpointError(f"model.lora.base={source.directory} was saved with a different model section: copy "
                          "its model section into this config and add `lora:` and `quantization:` to it")
  floats = Runtime(plain, runtime.mesh_config, runtime.mesh.devices.flat, seed=runtime.seed)
  params = source.read_params(floats.abstract_targets()[0])
  return quantize_params(params, runtime, shardings)


def read_network(runtime, path, key: str) -> dict:
  """The parameters of checkpoint `path` (None: the model's init from its seed), which must
  hold this runtime's network without adapters, placed on its shardings. `key` names the
  config key that gave the path, for the error."""
  if path is None:
    with runtime.context():
      return jax.jit(lambda: runtime.create()[0], out_shardings=runtime.param_shardings)()
  with SavedRun(path) as source:
    if source.config.model.frozen_base is not None or not same_network(runtime.model_config, source.config.model):
      raise CheckpointError(f"{key}={path} holds another model (or adapters): give a checkpoint "
                            "of this config's model section (merge adapters first: `jaxpar lora merge`)")
    return source.read_params(runtime.abstract_targets()[0])
