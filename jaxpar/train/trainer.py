"""The trainer: runtime + sharded train state + jitted step + data + metrics, from one Config."""

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from rich.console import Console

from jaxpar.checkpoint import TOKENIZER_DIR, Checkpointer
from jaxpar.config import Config, checkpoint_dir
from jaxpar.data import copy_tokenizer_files, load_tokenizer
from jaxpar.train.flops import measure_matmul_flops, train_flops_per_token
from jaxpar.mesh import logical_to_sharding
from jaxpar.train.evaluator import Evaluator, flat_metrics, jit_eval_step
from jaxpar.train.metrics import PROGRESS_EXTRAS, MetricsLogger, StepClock, scalars
from jaxpar.train.moments import narrow_moments
from jaxpar.train.optim import (learning_rate_schedule, make_optimizer, opt_state_shardings, update_rule,
                                state_bytes_per_param)
from jaxpar.cluster.preemption import stop_on_signals
from jaxpar.cluster.run_lock import hold_run_dirs
from jaxpar.errors import ConfigError
from jaxpar.runtime import Runtime, with_shardings
from jaxpar.objectives import get_objective
from jaxpar.train.frozen import FrozenWeights
from jaxpar.train.resume import check_same_run, finished_line, remove_saved_run
from jaxpar.train.state import TrainState
from jaxpar.train.trackers import check_installed
from jaxpar.weights import SavedRun
from jaxpar.train.replicas import ReplicaTraining
from jaxpar.train.offload import HostOptimizer, in_host_memory
from jaxpar.train.step import make_train_step, make_update
from jaxpar.cluster.xla_flags import compiler_options

_log = logging.getLogger(__name__)


@dataclass
class TrainResult:
  state: TrainState
  history: list[dict] = field(default_factory=list)
  summary: dict = field(default_factory=dict)


class Trainer:
  """Everything `jaxpar train` does, as plain Python calls (usable from a notebook)."""

  def __init__(self, config: Config, devices=None, *, console: Console | None = None):
    self.config = config
    if config.model.quantization is not None and config.model.lora is None:
      raise ConfigError(f"model.quantization.mode={config.model.quantization.mode}: quantized "
                        "weights are for inference; train the float model, then `jaxpar quantize` "
                        "its checkpoint, or train adapters over it (model.lora: QLoRA)")
    check_installed(config.train.loggers)  # a missing wandb or mlflow, before anything compiles
    objective = get_objective(config.train.objective)
    devices = list(jax.devices() if devices is None else devices)
    # An objective may keep some devices for itself (reinforcement learning's rollouts).
    self.runtime = Runtime.from_config(config, objective.train_devices(config, devices))
    self.runtime.plan.check_training(config.model, config.data, config.train, self.rules)
    self.objective = objective(config, self.runtime, devices)
    self.frozen = FrozenWeights(self.runtime, self.objective)
    self.console = console or Console()
    # Under model.lora the optimizer sees the adapters only: the base is TrainState.frozen.
    rule_args = (self.frozen.trainable(self.runtime.decay_mask), self.frozen.trainable(self.runtime.axis_names))
    optimizer = make_optimizer(config.train, *rule_args)
    self.optimizer = narrow_moments(optimizer, config.train.optimizer_state_dtype,
                                    self.frozen.trainable(self.runtime.abstract_params),
                                    self.frozen.trainable(self.runtime.axis_names))
    self.schedule = learning_rate_schedule(config.train)
    self.state_shardings = self._state_shardings()
    self.batch_sharding = logical_to_sharding(("batch", "length"), None, self.mesh, self.rules)
    batch_shardings = {k: self.batch_sharding for k in self.objective.batch_keys}
    self.xla_options, self.xla_notes = compiler_options(config.mesh.xla_flags, self.mesh.devices.flat)
    self._eval_step = None  # built with the first evaluator
    loss, micro = self.objective.loss(), config.train.microbatches
    self.replicas = None  # train.sync=allreduce: one program, gradients all-reduced every step
    if config.train.sync != "allreduce":
      self.replicas = ReplicaTraining(
          config, self.runtime, make_update(loss, self.optimizer, self.schedule, microbatches=micro),
          self.optimizer, self.state_shardings, self.frozen.trainable(self.runtime.abstract_params),
          self.frozen.trainable(self.runtime.axis_names), batch_shardings, self.xla_options or None)
      self.state_shardings = self.state_shardings.replace(opt_state=self.replicas.opt_state_shardings())
      self.train_step = self.replicas.program(None)  # the inner step; `step` picks a sync's program when due
    else:
      host = None
      if config.train.offload_optimizer == "host":
        host = HostOptimizer(update_rule(config.train, *rule_args), config.train.grad_clip,
                             self.state_shardings.params)
      self.train_step = jax.jit(make_train_step(loss, self.optimizer, self.schedule, microbatches=micro,
                                                host_optimizer=host),
                                in_shardings=(self.state_shardings, batch_shardings),
                                out_shardings=(self.state_shardings, None), donate_argnums=0,
                                compiler_options=self.xla_options or None)

  mesh = property(lambda self: self.runtime.mesh)
  rules = property(lambda self: self.runtime.rules)
  graphdef = property(lambda self: self.runtime.graphdef)
  num_params = property(lambda self: self.runtime.num_params)

  def context(self):
    """The mesh and logical rules that tracing model code needs."""
    return self.runtime.context()

  @property
  def trained_params(self) -> int:
    """The parameters the optimizer updates (under model.lora: the adapters alone)."""
    return sum(leaf.size for leaf in jax.tree.leaves(self.frozen.trainable(self.runtime.abstract_params)))

  @property
  def optimizer_bytes_per_param(self) -> float:
    """Optimizer-state bytes per parameter (AdamW in float32: 8; SGD with momentum: 4)."""
    abstract_opt = jax.eval_shape(self.optimizer.init, self.frozen.trainable(self.runtime.abstract_params))
    return state_bytes_per_param(abstract_opt, self.num_params)

  def _state_shardings(self) -> TrainState:
    params, frozen = self.frozen.split(self.runtime.param_shardings)
    abstract = self.frozen.trainable(self.runtime.abstract_params)
    opt = opt_state_shardings(jax.eval_shape(self.optimizer.init, abstract), abstract, params, self.mesh)
    if self.config.train.offload_optimizer == "host":
      opt = in_host_memory(opt)
    return TrainState(step=NamedSharding(self.mesh, PartitionSpec()), params=params, opt_state=opt,
                      model_state=self.runtime.model_state_shardings, frozen=frozen)

  def _create_state(self, with_frozen=True) -> TrainState:
    params, model_state = self.runtime.create()
    params, frozen = self.frozen.split(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self._init_opt(params),
                      model_state=model_state, frozen=frozen if with_frozen else {})

  def _init_opt(self, params):
    """A fresh optimizer state (with train.sync, the replicas' too) for these parameters."""
    return self.optimizer.init(params) if self.replicas is None else self.replicas.init_opt_state(params)

  def abstract_state(self) -> TrainState:
    """ShapeDtypeStructs with shardings: for AOT compiles and checkpoint restores."""
    with self.context():
      shapes = jax.eval_shape(self._create_state)
    return with_shardings(shapes, self.state_shardings)

  def init_state(self) -> TrainState:
    """A fresh state; under model.lora, fresh adapters over the base model.lora.base names;
    with networks the objective keeps (a reference), those read from their sources, and the
    policy starting as one of them where the objective says."""
    if not self.frozen.any:
      with self.context():
        return jax.jit(self._create_state, out_shardings=self.state_shardings)()
    with self.context():
      state = jax.jit(lambda: self._create_state(with_frozen=False),
                      out_shardings=self.state_shardings.replace(frozen={}))()
    state = state.replace(frozen=self.frozen.load())
    start = self.frozen.starting_policy(state.frozen)
    return state if start is None else state.replace(params=start)

  def tokenizer(self):
    return load_tokenizer(self.config.data.tokenizer)

  def batches(self, tokenizer=None):
    """The objective's endless global batches, on the batch sharding."""
    tokenizer = tokenizer or self.tokenizer()
    if tokenizer.vocab_size > self.config.model.vocab_size:
      raise ConfigError(f"model.vocab_size={self.config.model.vocab_size} is smaller than the "
                       f"tokenizer's {tokenizer.vocab_size} tokens: raise model.vocab_size")
    return self.objective.batches(tokenizer, self.batch_sharding)

  def evaluator(self, tokenizer=None, sources=None, **options) -> Evaluator:
    """The config's eval sets on this trainer's mesh and shardings (jaxpar/train/evaluator.py);
    `sources`: the training loader's, so nothing is read twice. Every evaluator of a trainer
    shares one eval step, so it compiles once."""
    shardings = (self.runtime.param_shardings, self.state_shardings.model_state, self.batch_sharding)
    if self._eval_step is None:
      self._eval_step = jit_eval_step(self.runtime, self.config.train.logits_chunk_len, *shardings)
    return Evaluator(self.config, self.runtime, tokenizer or self.tokenizer(), *shardings, sources=sources,
                     step=self._eval_step, **options)

  def step(self, state, batch, number: int | None = None):
    """One train step (`number`, 1-based: which step this is; default: read from the state).
    With train.sync, a step after which a fragment syncs runs that sync's program."""
    program = self.train_step
    if self.replicas is not None:
      program = self.replicas.program(self.replicas.due(int(state.step) + 1 if number is None else number))
    with self.context():
      return program(state, batch)

  def peak_flops(self) -> float:
    """Whole-mesh peak FLOP/s: from the config, or measured on CPU (one host = one peak,
    however many simulated devices share its cores)."""
    per_device = self.config.train.peak_flops_per_device
    if per_device:
      return per_device * self.mesh.size
    return measure_matmul_flops(jnp.dtype(self.config.model.compute_dtype))

  def state_from(self, params) -> TrainState:
    """A state at step 0 over `params` (a fresh optimizer; train.sync's replicas starting
    there): a warm start from another run's weights."""
    state = self.init_state()
    params = jax.device_put(params, self.state_shardings.params)
    with self.context():
      opt_state = jax.jit(self._init_opt, out_shardings=self.state_shardings.opt_state)(params)
    return state.replace(params=params, opt_state=opt_state)

  def fit(self, state=None, batches=None, *, steps=None, show_progress=True,
          restore=None, overwrite=False) -> TrainResult:
    """Train `steps` more steps (default: up to train.steps in all). With no `state`, starts
    from `restore` (a checkpoint dir or step dir), else the run's latest checkpoint, else fresh.
    Saves on the checkpoint schedule and at the end; SIGTERM/SIGINT stop after the current
    step (with several processes: the same step on all) with a checkpoint written
    (`summary["stopped_by"]`, `summary["checkpoint"]`). The run directory is locked meanwhile:
    a second job on it fails with ValueError naming the holder. A saved run with other
    settings is refused (jaxpar/train/resume.py); `overwrite` removes it first."""
    with hold_run_dirs(self._written_dirs(), say=self._say):
      if overwrite:
        removed = remove_saved_run(self.config)
        if removed:
          self._say(f"--overwrite: removed {', '.join(removed)}")
      return self._fit(state, batches, steps, show_progress, restore)

  def _written_dirs(self) -> list[Path]:
    run_dir = Path(self.config.train.run_dir).absolute()
    checkpoints = checkpoint_dir(self.config).absolute()
    outside = self.config.checkpoint.enabled and not checkpoints.is_relative_to(run_dir)
    return [run_dir, checkpoints] if outside else [run_dir]

  def _fit(self, state, batches, steps, show_progress, restore) -> TrainResult:
    cfg = self.config
    batches = batches or self.batches()
    checkpointer = Checkpointer(checkpoint_dir(cfg), cfg.checkpoint) if cfg.checkpoint.enabled else None
    if checkpointer is not None and checkpointer.leftovers:
      self._say(f"removing the leftovers of an interrupted save in {checkpointer.directory}: "
                f"{', '.join(checkpointer.leftovers)}")
    if checkpointer is not None and cfg.data.tokenizer != "byte" and jax.process_index() == 0:
      # Checkpoints carry their tokenizer, so generation needs no path from this run.
      copy_tokenizer_files(cfg.data.tokenizer, checkpointer.directory / TOKENIZER_DIR)
    try:
      with stop_on_signals() as stop:  # from here: a signal during the restore stops after step 1
        if state is None:
          state = self._start_state(checkpointer, batches, restore)
        start_step = int(state.step)
        if steps is None and start_step >= cfg.train.steps:
          self._say(finished_line(cfg, start_step))
        steps = max(cfg.train.steps - start_step, 0) if steps is None else steps
        stop.begin(start_step)
        evaluator = self.evaluator(getattr(batches, "tokenizer", None), getattr(batches, "sources", None)) \
            if cfg.eval.every_steps and steps else None
        state, history, summary = self._loop(state, batches, start_step, steps, show_progress,
                                             checkpointer, stop, evaluator)
        if hasattr(batches, "finish") and history:  # e.g. RL's held-out prompts on the final weights
          summary.update(batches.finish(state))
      if checkpointer is not None and history:
        last = start_step + len(history)
        checkpointer.save(last, state.items(), data_state=_data_state(batches), config=cfg, force=True)
        checkpointer.wait()
        summary["checkpoint"] = str(checkpointer.path(last))
    finally:
      if checkpointer is not None:
        checkpointer.close()
    return TrainResult(state=state, history=history, summary=summary)

  def _start_state(self, checkpointer, batches, restore) -> TrainState:
    if restore is not None:
      source = SavedRun(restore)
      start = self.objective.policy_start
      if start is not None and source.config.train.objective != self.config.train.objective:
        source.close()
        raise ConfigError(f"--restore {restore} with train.objective={self.config.train.objective}: the policy "
                          f"starts from objective.{start}; set objective.{start}={restore} instead")
    elif checkpointer is not None and checkpointer.latest_step() is not None:
      source = SavedRun(checkpointer.directory, checkpointer.latest_step())
      try:
        check_same_run(source.config, self.config, source.step)
      except ConfigError:
        source.close()
        raise
    else:
      return self.init_state()
    with source:
      if self.replicas is not None:
        self.replicas.check_restore(source)
      items, data_state = source.restore_train_state(self.runtime, self.abstract_state().items())
      where = source.path
    state = TrainState(**items)
    if self.frozen.any:  # the base or a kept network: from its own place
      state = state.replace(frozen=self.frozen.load())
    if state.opt_state is None:  # a params-only checkpoint (an imported model): fine-tune it
      with self.context():
        opt_state = jax.jit(self._init_opt, out_shardings=self.state_shardings.opt_state)(state.params)
      state = state.replace(opt_state=opt_state)
      self._say(f"starting from the parameters in {where}, with a fresh optimizer")
    else:
      self._say(f"resumed from step {int(state.step)} ({where})")
    if data_state and hasattr(batches, "set_state"):
      batches.set_state(data_state)
    return state

  def _say(self, text: str):
    if jax.process_index() == 0:
      self.console.print(text, markup=False, highlight=False, soft_wrap=True)

  def _loop(self, state, batches, start_step, steps, show_progress, checkpointer, stop, evaluator=None):
    cfg = self.config
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops_per_step = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    peak = self.peak_flops()
    logger = MetricsLogger(cfg.train.run_dir, start_step + steps, start_step=start_step,
                           show_progress=show_progress, console=self.console, loggers=cfg.train.loggers,
                           config=cfg.model_dump(mode="json"))
    clock = StepClock()
    pending, started = None, time.perf_counter()
    try:
      for step in range(start_step + 1, start_step + steps + 1):
        if hasattr(batches, "follow"):  # an objective that generates: from the current weights
          batches.follow(state)
        if self.replicas is not None and self.replicas.first_use(step):
          clock.pause_after(step - 1)  # this step compiles a sync's program: not a step time
        state, metrics = self.step(state, next(batches), step)
        if hasattr(batches, "host_metrics"):
          metrics = {**metrics, **batches.host_metrics()}
        clock.watch(step, metrics)
        stopping = stop.check(step)
        if checkpointer is not None:
          checkpointer.save(step, state.items(), data_state=_data_state(batches), config=cfg)
        if pending is not None:  # read the previous step's metrics: keeps dispatch async
          self._log(logger, clock, pending, tokens_per_step, flops_per_step, peak)
        every = cfg.eval.every_steps
        if evaluator is not None and not stopping and (step % every == 0 or step == start_step + steps):
          metrics = {**metrics, **flat_metrics(evaluator.run(state.weights(), state.model_state))}
          clock.pause_after(step)  # the evaluation is not part of the next step's time
        pending = (step, metrics)
        if stopping:
          if stop.agreed:
            _log.warning("%s: stopping after step %d, as all %d processes do", stop.signal,
                         step, jax.process_count())
          break
      if pending is not None:
        self._log(logger, clock, pending, tokens_per_step, flops_per_step, peak)
    finally:
      clock.close()
      logger.close()
    history = logger.history
    timed = [h for h in history if "step_time_s" in h][1:]  # the first timed step still warms up
    summary = {"steps": len(history), "params": self.num_params,
               "first_loss": history[0]["loss"] if history else None,
               "final_loss": history[-1]["loss"] if history else None,
               "wall_s": time.perf_counter() - started, "stopped_by": stop.signal if stop else None,
               **{k: history[-1][k] for k in PROGRESS_EXTRAS if history and k in history[-1]}}
    heldout = [{k: v for k, v in h.items() if k.startswith("heldout_")} for h in history]
    if any(heldout):
      summary["heldout_start"] = next(h for h in heldout if h)
    evals = [h for h in history if any(k.startswith("eval/") for k in h)]
    if evals:
      summary["eval_step"] = evals[-1]["step"]
      summary["eval"] = {k: v for k, v in evals[-1].items() if k.startswith("eval/")}
    if len(getattr(batches, "names", ())) > 1:  # a mixture: what it drew, beside its weights
      summary["data_proportions"] = batches.proportions()
    if timed:
      step_time = sum(h["step_time_s"] for h in timed) / len(timed)
      summary.update(step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                     mfu=flops_per_step / step_time / peak)
    return state, history, summary

  def _log(self, logger, clock, pending, tokens_per_step, flops_per_step, peak):
    step, metrics = pending
    values = jax.device_get(metrics)
    values = scalars(values if self.replicas is None else self.replicas.host_metrics(values))
    dt = clock.step_time(step)  # None for the first step of a run: it includes compiling
    if dt is not None:
      # The model's FLOPs: a pipeline's bubble iterations are idle time, not useful work.
      values.update(step_time_s=dt, tokens_per_s=tokens_per_step / dt, mfu=flops_per_step / dt / peak)
    if self.runtime.plan.pipelined:
      values["pipeline_bubble"] = self.runtime.plan.bubble_fraction
    every = self.config.train.log_every
    logger.log(step, values, echo=every > 0 and (step % every == 0 or step == 1), echo_eval=every > 0)


def _data_state(batches) -> dict | None:
  """The iterator's resumable state, when it has one (the objectives' batches do; a plain iterator not)."""
  return batches.get_state() if hasattr(batches, "get_state") else None


def train(config: Config, devices=None, **fit_kwargs) -> TrainResult:
  return Trainer(config, devices).fit(**fit_kwargs)
