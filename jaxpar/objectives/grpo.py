"""Group Relative Policy Optimization and its variants (`train.objective: grpo`): reinforcement
learning from verifiable rewards over a prompt dataset (data.format=prompts: rows
{"prompt": text or messages, "answer": ..., any other fields}).

Each step's batch is data.global_batch_size completions: global_batch_size / group_size
prompts, each sampled group_size times on the engine with the current weights
(jaxpar/rl/rollouts.py), scored by the rewards (jaxpar/rl/rewards.py), given group-relative
advantages, and trained on with the clipped surrogate of objective.loss
(jaxpar/rl/losses.py); a rollout batch serves objective.inner_steps updates.

With objective.kl_coef > 0 the loss adds a KL penalty to a reference: without adapters a
frozen copy of objective.reference (the checkpoint the policy starts from, as DPO's), under
model.lora the base with the adapters off. Without adapters the policy always starts as
objective.reference (the SFT'd model), kept beside it whatever kl_coef is.
"""

from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from pydantic import Field, model_validator

from jaxpar.errors import ConfigError
from jaxpar.objectives.base import (BASE, Objective, Options, model_state_of, policy_weights,
                                    register_objective)
from jaxpar.objectives.scoring import sequence_logprobs
from jaxpar.rl.ahead import AheadRollouts
from jaxpar.rl.environments import load_environment
from jaxpar.rl.losses import LOSSES, policy_loss
from jaxpar.rl.rewards import Rewards
from jaxpar.rl.rollouts import KEYS, Rollouts
from jaxpar.runtime import Runtime
from jaxpar.trees import join

REFERENCE = "reference"


class GRPOOptions(Options):
  group_size: int = Field(8, ge=2)  # samples per prompt
  loss: Literal[LOSSES] = "grpo"  # type: ignore[valid-type]
  clip_low: float = Field(0.2, ge=0, lt=1)  # ratio clipped to [1 - clip_low, 1 + clip_high]
  clip_high: float | None = Field(None, ge=0)  # None: clip_low (DAPO raises it: 0.28)
  kl_coef: float = Field(0.0, ge=0)  # k3 KL to the reference; 0: not computed
  inner_steps: int = Field(1, ge=1)  # updates per rollout batch (mu)
  dynamic_sampling: bool = False  # drop groups whose rewards are all equal (DAPO)
  max_tokens: int = Field(64, ge=1)  # per completion
  stop: tuple[str, ...] = ()  # stop strings; default: the chat template's end of turn
  rewards: dict[str, float] = {"exact_answer": 1.0}  # name or module:function -> weight
  format_pattern: str | None = None  # the `format` reward's regular expression
  # Rollouts drawn under a constraint, as structured output draws them: one of {"regex": ...},
  # {"json": schema}, {"choice": [...]}, {"grammar": lark} (jaxpar/inference/grammar.py).
  constraint: dict[str, Any] | None = None
  overlong_buffer: int = Field(0, ge=0)  # the `overlong` reward's soft band (tokens)
  # Where rollouts run. 0: on the trainer's devices (collocated, in turn with training); n:
  # on the first n devices given, training on the rest (split). rollout_mesh: the engine's
  # layout, as overrides of the mesh section (e.g. {fsdp: 1, tensor: 2}); default the
  # trainer's mesh when collocated, data parallel over the rollout devices when split.
  rollout_devices: int = Field(0, ge=0)
  rollout_mesh: dict[str, int | str] = {}
  # Off-policy: rollouts run this many updates ahead of training, on rollout devices of their
  # own (jaxpar/rl/ahead.py); 0: exactly on-policy, rollouts and updates in turn.
  max_staleness: int = Field(0, ge=0)
  # The checkpoint the policy starts from and the KL reference (without adapters).
  reference: str | None = None
  # The behaviour log-probs the ratio divides by. engine: those the engine recorded as it
  # sampled (equal to the trainer's up to float rounding: decoding one token at a time sums
  # in another order than a whole-sequence forward). trainer: the policy's own, so the first
  # update's ratio is exactly 1 (that step's forward, under stop_gradient) and later inner
  # updates divide by a forward run before the first (one more forward per rollout batch);
  # the largest |engine - trainer| is reported as `behaviour_gap`.
  behaviour: Literal["engine", "trainer"] = "engine"
  # Held-out prompts (rows as data.source's) scored every eval_every steps, from step 0:
  # eval/pass@1 greedy, eval/pass@k over eval_samples samples; a pass is eval_reward = 1.
  eval_source: str | None = None
  eval_every: int = Field(0, ge=0)
  eval_samples: int = Field(1, ge=1)
  eval_reward: str = "exact_answer"
  # Multi-turn episodes (jaxpar/rl/environments.py): a built-in (calculator) or
  # package.module:Class with reset(row) and step(text) -> (observation, reward, done); the
  # policy takes up to max_turns turns of up to max_tokens each. Its rewards add up as the
  # `environment` reward, and objective.rewards (none unless given) score the last turn.
  environment: str | None = None
  max_turns: int = Field(4, ge=1)

  @model_validator(mode="before")
  @classmethod
  def _environment_defaults(cls, values):
    if isinstance(values, dict) and values.get("environment"):
      values = {"rewards": {}, "eval_reward": "environment", **values}
    return values

  @property
  def upper_clip(self) -> float:
    return self.clip_low if self.clip_high is None else self.clip_high

  @property
  def sampled_limit(self) -> int:
    """The most tokens the policy samples in one row: max_tokens per turn."""
    return self.max_tokens * (self.max_turns if self.environment else 1)


def behaviour_scorer(runtime, batch_sharding, chunk_len: int = 0):
  """jitted (policy weights, model_state, batch) -> (batch with its behaviour log-probs those of
  the policy's forward on its completion tokens, the largest |engine - trainer| there)."""
  def score(weights, model_state, batch):
    logp = sequence_logprobs(nnx.merge(runtime.graphdef, weights, model_state), batch, chunk_len)[0]
    mask = batch["loss_mask"] > 0
    gap = jnp.max(jnp.where(mask, jnp.abs(logp - batch["behaviour_logprobs"]), 0.0))
    return {**batch, "behaviour_logprobs": jnp.where(mask, logp, 0.0)}, gap

  jitted = jax.jit(score, out_shardings=({k: batch_sharding for k in KEYS}, None))

  def run(weights, model_state, batch):
    with runtime.context():
      return jitted(weights, model_state, batch)
  return run


def make_grpo_loss(graphdef, options, *, reference_kept: bool, chunk_len: int = 0):
  """The objective protocol's loss over rollout batches (rollouts.KEYS); chunk_len > 0: the
  logits chunk_len positions at a time (train.logits_chunk_len, scoring.sequence_logprobs)."""
  def loss(params, model_state, batch, frozen=None):
    frozen = frozen or {}
    model = nnx.merge(graphdef, policy_weights(params, frozen), model_state)
    logp, spread = sequence_logprobs(model, batch, chunk_len)
    # The first update on a batch scored by the trainer divides by its own forward: ratio 1 exactly.
    behaviour = jnp.where(batch["fresh"] > 0, jax.lax.stop_gradient(logp), batch["behaviour_logprobs"])
    reference = None
    if options.kl_coef:
      weights = frozen[REFERENCE] if reference_kept else join(jax.tree.map(jnp.zeros_like, params), frozen[BASE])
      reference = jax.lax.stop_gradient(sequence_logprobs(nnx.merge(graphdef, weights, model_state), batch,
                                                          chunk_len)[0])
    total, metrics, unit = policy_loss(
        logp, behaviour, batch["advantages"], batch["loss_mask"], loss=options.loss,
        clip_low=options.clip_low, clip_high=options.upper_clip, max_tokens=options.sampled_limit,
        reference=reference, kl_coef=options.kl_coef)
    mask = batch["loss_mask"]
    per_row = mask / jnp.maximum(jnp.sum(mask, -1, keepdims=True), 1.0)
    sums = {"ce_sum": total, "z_sum": jnp.zeros(()), "tokens": unit,
            **{f"metric/{k}": v for k, v in metrics.items()},
            "metric/entropy": jnp.sum(spread * (mask if options.loss == "dapo" else per_row))}
    return total, (sums, model_state_of(model))
  return loss


@register_objective
class GRPO(Objective):
  name = "grpo"
  formats = ("prompts",)
  Options = GRPOOptions
  batch_keys = KEYS

  @classmethod
  def train_devices(cls, config, devices):
    count = config.objective.rollout_devices
    if count and count >= len(devices):
      raise ConfigError(f"objective.rollout_devices={count} leaves none of the {len(devices)} devices to train on: "
                        "give rollouts fewer, or 0 to run them on the trainer's devices in turn")
    return devices[count:]

  def rollout_runtime(self):
    """The engine's runtime: the trainer's, unless rollouts have devices or a layout of their own."""
    opts = self.options
    if not opts.rollout_devices and not opts.rollout_mesh:
      return self.runtime
    devices = self.devices[:opts.rollout_devices] if opts.rollout_devices else self.devices
    base = {} if not opts.rollout_devices else {axis: 1 for axis in self.config.mesh.axis_sizes()} | {"data": -1}
    mesh = type(self.config.mesh).model_validate({**self.config.mesh.model_dump(), **base, **opts.rollout_mesh})
    return Runtime(self.config.model, mesh, devices, seed=self.config.train.seed)

  def check(self):
    super().check()
    opts, data = self.options, self.config.data
    if data.global_batch_size % opts.group_size:
      raise ConfigError(f"data.global_batch_size={data.global_batch_size} completions per step is not a multiple of "
                        f"objective.group_size={opts.group_size}: make it prompts per step x group_size")
    if self.adapters and opts.reference is not None:
      raise ConfigError(f"objective.reference={opts.reference} with model.lora: the policy is the base plus adapters "
                        "and the reference the base; drop objective.reference (set model.lora.base)")
    every = self.config.checkpoint.every_steps
    if opts.inner_steps > 1 and every and every % opts.inner_steps:
      raise ConfigError(f"checkpoint.every_steps={every} with objective.inner_steps={opts.inner_steps}: save on rollout "
                        "boundaries (a multiple of inner_steps), so a resume draws the same rollouts")
    if opts.max_staleness and not opts.rollout_devices:
      raise ConfigError(f"objective.max_staleness={opts.max_staleness} runs rollouts beside training: give them "
                        "devices of their own (objective.rollout_devices), or set max_staleness 0")
    if opts.max_staleness and opts.behaviour == "trainer":
      raise ConfigError("objective.behaviour=trainer rescoring needs the weights that sampled; off-policy batches "
                        "(objective.max_staleness) use the engine's recorded log-probs: set objective.behaviour=engine")
    if opts.max_staleness and (opts.inner_steps > 1 or opts.eval_every):
      raise ConfigError(f"objective.max_staleness={opts.max_staleness} draws one batch per update and evaluates "
                        "nothing: set objective.inner_steps=1 and objective.eval_every=0")
    if self.config.eval.every_steps:
      raise ConfigError("eval.every_steps evaluates a language model's loss on text; reinforcement learning evaluates "
                        "held-out prompts: set objective.eval_source and objective.eval_every instead")
    scored = [*opts.rewards, *(["environment"] if opts.environment else [])]
    if opts.eval_source and opts.eval_reward not in scored:
      raise ConfigError(f"objective.eval_reward={opts.eval_reward} is not one of the rewards "
                        f"({', '.join(scored) or 'none'}): name the reward whose 1 is a pass")
    if not scored:
      raise ConfigError("objective.rewards is empty and there is no objective.environment: nothing scores the "
                        "rollouts; give a reward, e.g. objective.rewards={exact_answer: 1.0}")
    if opts.environment:
      load_environment(opts.environment)  # says now if it does not import or lacks reset/step
    self.rewards = Rewards(opts.rewards, format_pattern=opts.format_pattern, max_tokens=opts.sampled_limit,
                           overlong_buffer=opts.overlong_buffer)

  def batches(self, tokenizer, sharding):
    chunk_len = self.config.train.logits_chunk_len
    scorer = behaviour_scorer(self.runtime, sharding, chunk_len) if self.options.behaviour == "trainer" else None
    rollouts = Rollouts(self.config, self.rollout_runtime(), tokenizer, sharding, self.rewards, scorer)
    return AheadRollouts(rollouts, self.options.max_staleness) if self.options.max_staleness else rollouts

  def loss(self):
    return make_grpo_loss(self.runtime.graphdef, self.options, reference_kept=not self.adapters,
                          chunk_len=self.config.train.logits_chunk_len)

  def kept_networks(self):
    return {} if self.adapters else {REFERENCE: self.options.reference}

  @property
  def policy_start(self):
    return None if self.adapters else REFERENCE
