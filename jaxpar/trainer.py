"""The trainer: mesh + sharded state + jitted step + data + metrics, driven by one Config."""

import contextlib
import math
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import Config
from jaxpar.data import TrainBatches, load_tokenizer
from jaxpar.flops import measure_matmul_flops, train_flops_per_token
from jaxpar.mesh import build_mesh, logical_to_sharding, resolve_rules
from jaxpar.mesh.rules import unused_mesh_axes
from jaxpar.metrics import MetricsLogger
from jaxpar.model_state import abstract_model, count_params, init_params, param_shardings
from jaxpar.optim import learning_rate_schedule, make_optimizer
from jaxpar.train_step import make_train_step

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


@dataclass
class TrainResult:
  state: dict
  history: list[dict] = field(default_factory=list)
  summary: dict = field(default_factory=dict)


class Trainer:
  """Everything `jaxpar train` does, as plain Python calls (usable from a notebook)."""

  def __init__(self, config: Config, devices=None):
    self.config = config
    self.mesh = build_mesh(config.mesh, devices)
    self.rules = resolve_rules(config.mesh.rules)
    unused = unused_mesh_axes(self.rules, dict(self.mesh.shape))
    if unused:
      raise ValueError(f"mesh.{unused[0]}={self.mesh.shape[unused[0]]} but mesh.rules="
                       f"{config.mesh.rules!r} never uses that axis: pick rules that do "
                       "(e.g. fsdp_tp) or set it to 1")
    batch = config.data.global_batch_size // config.train.microbatches
    batch_shards = math.prod(self.mesh.shape[a] for a in dict(self.rules)["batch"])
    if batch % batch_shards:
      raise ValueError(f"data.global_batch_size={config.data.global_batch_size} "
                       f"(/ train.microbatches={config.train.microbatches}) must divide over the "
                       f"{batch_shards} batch shards of the mesh")
    self.graphdef, self.abstract_params = abstract_model(config.model, config.train.seed)
    self.num_params = count_params(self.abstract_params)
    self.optimizer = make_optimizer(config.train)
    self.schedule = learning_rate_schedule(config.train)
    self.state_shardings = self._state_shardings()
    self.batch_sharding = logical_to_sharding(("batch", "length"), None, self.mesh, self.rules)
    step = make_train_step(self.graphdef, self.optimizer, self.schedule,
                           z_loss=config.train.z_loss, microbatches=config.train.microbatches)
    batch_shardings = {k: self.batch_sharding for k in BATCH_KEYS}
    self.train_step = jax.jit(step, in_shardings=(self.state_shardings, batch_shardings),
                              out_shardings=(self.state_shardings, None), donate_argnums=0)

  def _state_shardings(self) -> dict:
    params = param_shardings(self.abstract_params, self.mesh, self.rules)
    replicated = NamedSharding(self.mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(self.optimizer.init, self.abstract_params.to_pure_dict())
    opt = optax.tree_map_params(self.optimizer, lambda _, s: s, abstract_opt, params,
                                transform_non_params=lambda _: replicated)
    return {"step": replicated, "params": params, "opt_state": opt}

  def _create_state(self) -> dict:
    params = init_params(self.config.model, self.config.train.seed, self.state_shardings["params"])
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.optimizer.init(params)}

  def abstract_state(self) -> dict:
    """ShapeDtypeStructs with shardings: for AOT compiles and checkpoint restores."""
    with self.context():
      shapes = jax.eval_shape(self._create_state)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, self.state_shardings)

  def init_state(self) -> dict:
    with self.context():
      return jax.jit(self._create_state, out_shardings=self.state_shardings)()

  def tokenizer(self):
    return load_tokenizer(self.config.data.tokenizer)

  def batches(self, tokenizer=None) -> TrainBatches:
    tokenizer = tokenizer or self.tokenizer()
    if tokenizer.vocab_size > self.config.model.vocab_size:
      raise ValueError(f"model.vocab_size={self.config.model.vocab_size} is smaller than the "
                       f"tokenizer's {tokenizer.vocab_size} tokens: raise model.vocab_size")
    return TrainBatches(self.config.data, tokenizer, self.batch_sharding)

  @contextlib.contextmanager
  def context(self):
    """The mesh and logical rules that tracing model code needs."""
    with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.rules):
      yield

  def step(self, state, batch):
    with self.context():
      return self.train_step(state, batch)

  def peak_flops(self) -> float:
    """Whole-mesh peak FLOP/s: from the config, or measured on CPU (one host = one peak,
    however many simulated devices share its cores)."""
    per_device = self.config.train.peak_flops_per_device
    if per_device:
      return per_device * self.mesh.size
    return measure_matmul_flops(jnp.dtype(self.config.model.compute_dtype))

  def fit(self, state=None, batches=None, *, steps=None, show_progress=True) -> TrainResult:
    cfg = self.config
    steps = cfg.train.steps if steps is None else steps
    state = self.init_state() if state is None else state
    batches = batches or self.batches()
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops_per_step = train_flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    peak = self.peak_flops()
    start_step = int(state["step"])
    logger = MetricsLogger(cfg.train.run_dir, start_step + steps, start_step=start_step,
                           show_progress=show_progress)
    pending, last_time, started = None, None, time.perf_counter()
    try:
      for _ in range(steps):
        state, metrics = self.step(state, next(batches))
        if pending is not None:  # read the previous step's metrics: keeps dispatch async
          last_time = self._log(logger, pending, last_time, tokens_per_step, flops_per_step, peak)
        pending = (int(state["step"]), metrics)
      if pending is not None:
        self._log(logger, pending, last_time, tokens_per_step, flops_per_step, peak)
    finally:
      logger.close()
    history = logger.history
    timed = [h for h in history if "step_time_s" in h][1:]  # the first timed step still warms up
    summary = {"steps": len(history), "params": self.num_params,
               "first_loss": history[0]["loss"] if history else None,
               "final_loss": history[-1]["loss"] if history else None,
               "wall_s": time.perf_counter() - started}
    if timed:
      step_time = sum(h["step_time_s"] for h in timed) / len(timed)
      summary.update(step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                     mfu=flops_per_step / step_time / peak)
    return TrainResult(state=state, history=history, summary=summary)

  def _log(self, logger, pending, last_time, tokens_per_step, flops_per_step, peak):
    step, metrics = pending
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    if last_time is not None:
      dt = now - last_time
      values.update(step_time_s=dt, tokens_per_s=tokens_per_step / dt, mfu=flops_per_step / dt / peak)
    every = self.config.train.log_every
    logger.log(step, values, echo=every > 0 and (step % every == 0 or step == 1))
    return now


def train(config: Config, devices=None, **fit_kwargs) -> TrainResult:
  return Trainer(config, devices).fit(**fit_kwargs)
