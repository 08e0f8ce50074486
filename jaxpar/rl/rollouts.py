"""Rollouts: prompts sampled `group_size` times on the project's engine with the policy's
current weights, scored, and laid out as training rows.

The engine runs on the trainer's mesh and reads the trainer's arrays as they are (collocated:
no copy where the layouts agree; `Engine.load_weights` reshards on device where they do
not). Each group's samples share their prompt's cache pages (prefix caching): a prompt is
prefilled once per group. The engine records each sampled token's log-probability with the
same function (models/logprobs.py) the loss recomputes it with, so at the first update of a
rollout batch the policy ratio is 1 up to the difference between decoding one token at a
time and the trainer's whole-sequence forward.

A row: the prompt, then the completion (with the stop token that ended it, which the policy
sampled too); targets carry loss on the completion's tokens only. With objective.environment
a row is a multi-turn episode's transcript (jaxpar/rl/environments.py): loss on the policy's
turns, none on the observations between them. Every `inner_steps` steps a
new rollout batch is drawn; the steps between update on the same one (their ratios move away
from 1 and are clipped). State for resuming: the next prompt and the rollouts drawn.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.data.chat_batches import chat_renderer, read_rows
from jaxpar.data.loader import TOKEN_KEYS, _globalize, _process_rows
from jaxpar.errors import ConfigError, DataError
from jaxpar.inference import grammar
from jaxpar.inference.engine import Engine, bytes_to_move
from jaxpar.inference.sampling import RequestError, SamplingParams
from jaxpar.objectives.base import policy_weights
from jaxpar.rl.environments import Episode, Observations, checked_step, load_environment
from jaxpar.rl.losses import group_advantages

# fresh: 1 on a batch's first update when objective.behaviour=trainer (the loss divides by its own forward).
KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "behaviour_logprobs", "advantages", "fresh")


def prompt_tokens(rows: list[dict], data_config, tokenizer):
  """(each row's prompt as generation prompt tokens, the stop string that ends an answer (the
  chat template's end of turn; None without a template), the chat renderer or None). A
  `prompt` that is a list of messages, or any prompt when data.chat_template is set, is
  rendered with the chat template (generation prompt added); a text prompt otherwise goes in
  as it is."""
  chat = data_config.chat_template is not None or any(isinstance(r.get("prompt"), list) for r in rows)
  renderer = chat_renderer(data_config, tokenizer) if chat else None
  prompts = []
  for i, row in enumerate(rows):
    if "prompt" not in row:
      raise DataError(f"row {i} of data.source={data_config.source!r} has no `prompt` field (it has {sorted(row)}): "
                      "reinforcement learning rows are {\"prompt\": text or messages, \"answer\": ...}")
    prompt = row["prompt"]
    if renderer is not None:
      prompt = renderer.render(first_messages(prompt), add_generation_prompt=True)
    prompts.append(tokenizer.encode_prompt(prompt))
  stop = renderer.end_of_turn() if renderer is not None else None
  return prompts, stop or None, renderer


def first_messages(prompt: str | list[dict]) -> list[dict]:
  return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def rollout_constraint(spec: dict | None, tokenizer, vocab: int):
  """objective.constraint ({kind: value}, one of grammar.constraint's kinds) compiled, or
  None; a bad one is a one-line ConfigError."""
  if spec is None:
    return None
  kinds = ("regex", "json", "choice", "grammar")
  if len(spec) != 1 or next(iter(spec)) not in kinds:
    raise ConfigError(f"objective.constraint={spec}: give one of {', '.join(kinds)}, e.g. "
                      "objective.constraint={regex: '[0-9]+'}")
  (kind, value), = spec.items()
  try:
    return grammar.constraint(kind, value, f"objective.constraint.{kind}", tokenizer, vocab)
  except RequestError as error:
    raise ConfigError(str(error)) from None


@functools.lru_cache(maxsize=2)
def _order(seed: int, count: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(count)


class Rollouts:
  """Endless RL batches for the trainer: follow(state) before each next() hands it the
  policy's weights; host_metrics() says what the last rollout measured."""

  def __init__(self, config, runtime, tokenizer, sharding, rewards, scorer=None):
    data, self.options = config.data, config.objective
    self.config, self.runtime, self.tokenizer, self.sharding, self.rewards = config, runtime, tokenizer, sharding, rewards
    self.rows = read_rows(data.source)
    self.prompts, stop, renderer = prompt_tokens(self.rows, data, tokenizer)
    self.stop = tuple(self.options.stop) or ((stop,) if stop else ())
    self.constraint = rollout_constraint(self.options.constraint, tokenizer, config.model.vocab_size)
    self.seq_len, self.batch = data.seq_len, data.global_batch_size
    self.groups = self.batch // self.options.group_size
    self.max_tokens = self.options.max_tokens
    self.environment = load_environment(self.options.environment) if self.options.environment else None
    self.observations = Observations(tokenizer, renderer)
    for i, prompt in enumerate(self.prompts):
      if len(prompt) + self.max_tokens > self.seq_len + 1:
        raise DataError(f"row {i} of data.source={data.source!r}: its prompt has {len(prompt)} tokens, and with "
                        f"objective.max_tokens={self.max_tokens} that is more than data.seq_len={self.seq_len} + 1: "
                        "raise data.seq_len, lower objective.max_tokens, or drop the row")
    self.seed = config.train.seed
    self.scorer = scorer  # objective.behaviour=trainer: the loss's forward scores each batch
    self._local = _process_rows(sharding, self.batch, self.seq_len)
    self.eval_rows = read_rows(self.options.eval_source) if self.options.eval_source else []
    self.eval_prompts = prompt_tokens(self.eval_rows, data, tokenizer)[0] if self.eval_rows else []
    self.engine = None
    self.last_episodes: list[Episode] = []  # the last rollout's
    self._weights, self._step, self._synced = None, 0, None
    self._next_prompt = 0
    self._drawn = 0  # rollout batches drawn
    self._inner = 0  # updates made on the current rollout batch
    self._batch = None
    self._metrics: dict = {}

  # -- the trainer's side --------------------------------------------------------------

  def follow(self, state):
    """The policy's current weights (a TrainState): the next rollout samples from them."""
    self._weights = self._trainer_weights = (policy_weights(state.params, state.frozen), state.model_state)
    self._step = int(state.step)

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    self._metrics = {}
    if self._batch is None or self._inner == self.options.inner_steps:
      self._batch, self._metrics = self._rollout()
      self._inner = 0
    elif self._inner == 1 and self.scorer is not None:  # later updates divide by the scored forward
      self._batch = {**self._batch, "fresh": self._zeros}
    every = self.options.eval_every
    if self.eval_rows and every and self._step % every == 0:
      self._metrics.update(self.evaluate())
    self._inner += 1
    return self._batch

  def host_metrics(self) -> dict:
    return self._metrics

  def finish(self, state) -> dict:
    """The run's summary entry: {"heldout": the final weights' held-out metrics}, or nothing
    without held-out prompts."""
    if not (self.eval_rows and self.options.eval_every):
      return {}
    self.follow(state)
    return {"heldout": self.evaluate()}

  def get_state(self) -> dict:
    return {"next_prompt": self._next_prompt, "rollouts": self._drawn}

  def set_state(self, state: dict):
    self._next_prompt = int(np.asarray(state["next_prompt"]))
    self._drawn = int(np.asarray(state["rollouts"]))

  # -- held-out prompts ----------------------------------------------------------------

  def evaluate(self) -> dict:
    """The current weights on objective.eval_source's prompts: heldout_pass@1 (greedy answers
    that pass: objective.eval_reward is 1), heldout_reward (their mean reward) and, with
    objective.eval_samples = k > 1, heldout_pass@k (some of k samples at temperature 1 passes)."""
    self._sync()
    greedy = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, stop=self.stop, constraint=self.constraint)
    metrics = {}
    count, where = len(self.eval_rows), "objective.eval_source"
    scores = self._scores(self._play(self.eval_prompts, self.eval_rows, range(count), [greedy] * count, where),
                          self.eval_rows, range(count), where)
    passed = self.options.eval_reward
    metrics["heldout_pass@1"] = float(np.mean([s[passed] >= 1 for s in scores]))
    metrics["heldout_reward"] = float(np.mean([s["reward"] for s in scores]))
    k = self.options.eval_samples
    if k > 1:
      rows, numbers = [row for row in self.eval_rows for _ in range(k)], [n // k for n in range(count * k)]
      samples = self._play([p for p in self.eval_prompts for _ in range(k)], rows, numbers,
                           [self.sampling(seed) for seed in range(len(rows))], where)
      hits = [s[passed] >= 1 for s in self._scores(samples, rows, numbers, where)]
      metrics[f"heldout_pass@{k}"] = float(np.mean(np.asarray(hits).reshape(-1, k).any(axis=1)))
    return metrics

  def _scores(self, episodes, rows, numbers, where) -> list[dict]:
    """Each episode's rewards: the reward functions on its last turn, plus the environment's."""
    scores = []
    for episode, row, n in zip(episodes, rows, numbers):
      score = self.rewards.score(episode.text, episode.generated, row, f"row {n} of {where}")
      if self.environment is not None:
        score = {**score, "environment": episode.reward, "reward": score["reward"] + episode.reward}
      scores.append(score)
    return scores

  # -- episodes ------------------------------------------------------------------------

  def _play(self, prompts, rows, numbers, settings, where) -> list[Episode]:
    """Each prompt sampled with its settings: one completion each, or with an environment a
    multi-turn episode each, all of a turn's requests on the engine at once. `numbers`: each
    row's number in `where`, for errors."""
    if self.environment is None:
      completions = self.engine.generate(prompts, settings)
      episodes = [Episode.start(c.prompt_tokens) for c in completions]
      for episode, completion in zip(episodes, completions):
        episode.add_turn(completion)
      return episodes
    name = self.options.environment
    episodes, environments, histories = [], [], []
    for prompt, row, number in zip(prompts, rows, numbers):
      environment = self.environment()
      self._call(environment.reset, (dict(row),), name, f"row {number} of {where} (reset)")
      environments.append(environment)
      episodes.append(Episode.start(prompt))
      histories.append(first_messages(row["prompt"]))
    playing = list(range(len(prompts)))
    for turn in range(self.options.max_turns):
      room = {n: self.seq_len + 1 - len(episodes[n].tokens) for n in playing}
      # The same seed every turn: a row's key comes from its seed and the position sampled.
      asked = [dataclasses.replace(settings[n], max_tokens=min(settings[n].max_tokens, room[n])) for n in playing]
      completions = self.engine.generate([episodes[n].tokens for n in playing], asked)
      going = []
      for n, completion in zip(playing, completions):
        episode = episodes[n]
        episode.add_turn(completion)
        if completion.finish_reason != "stop":  # cut at max_tokens: the environment sees whole turns only
          continue
        at = f"row {numbers[n]} of {where} (turn {turn + 1})"
        observation, reward, done = checked_step(self._call(environments[n].step, (completion.text,), name, at),
                                                 name, at)
        episode.reward += reward
        if done or turn + 1 == self.options.max_turns:
          continue
        tokens = self.observations.tokens(histories[n], completion.text, observation)
        if len(episode.tokens) + len(tokens) >= self.seq_len + 1:  # no room left for a token of the next turn
          continue
        episode.add_observation(tokens)
        going.append(n)
      playing = going
    return episodes

  @staticmethod
  def _call(method, args, name, where):
    try:
      return method(*args)
    except (DataError, ConfigError):
      raise
    except Exception as e:  # the user's environment: say whose, and on what
      raise DataError(f"environment {name} raised {type(e).__name__}: {e} on {where}") from e

  # -- one rollout batch ---------------------------------------------------------------

  def _engine(self, params, model_state) -> Engine:
    longest = max(len(p) for p in self.prompts + self.eval_prompts)
    chunk = max(16, 1 << (longest - 1).bit_length())
    return Engine(self.runtime, params, self.tokenizer, model_state=model_state, slots=self.batch,
                  max_seq_len=self.seq_len + 1, prefill_chunks=(16, chunk))

  def _sync(self) -> dict:
    """Point the engine at the policy's current weights: {sync_s, sync_bytes}."""
    if self._weights is None:
      raise RuntimeError("Rollouts.follow(state) must hand the policy's weights before each batch")
    if self._synced == self._step:
      return {}
    self._synced = self._step
    params, model_state = self._weights
    started = time.perf_counter()
    if self.engine is None:  # built on the first weights, laid out as the engine's runtime wants
      wanted = (self.runtime.param_shardings, self.runtime.model_state_shardings)
      moved = bytes_to_move((params, model_state), wanted)
      self.engine = self._engine(*jax.device_put((params, model_state), wanted))
    else:
      moved = self.engine.load_weights(self.changing(params), model_state)
    return {"sync_s": time.perf_counter() - started, "sync_bytes": float(moved)}

  def changing(self, params):
    """`params` with the leaves that never change after the first sync (a LoRA base: frozen)
    taken from the engine's own copy where it has one (another layout or other devices), so
    only the adapters move. Where the engine reads the trainer's arrays it takes the new ones:
    the update donated the old."""
    mask = self.runtime.adapter_mask
    if mask is None or self.engine is None:
      return params
    keep = lambda new, held, adapter: held if not adapter and held.sharding != new.sharding else new  # noqa: E731
    return jax.tree.map(keep, params, self.engine.params, mask)

  def _prompt_indices(self) -> list[int]:
    picked = []
    for n in range(self._next_prompt, self._next_prompt + self.groups):
      epoch, index = divmod(n, len(self.prompts))
      picked.append(int(_order(self.seed, len(self.prompts), epoch)[index]))
    self._next_prompt += self.groups
    return picked

  def sampling(self, seed: int) -> SamplingParams:
    # Temperature 1 and no filters: the behaviour policy is the model's own distribution,
    # whose log-probabilities the engine reports and the loss recomputes (under a constraint,
    # restricted to what it allows; the log-probabilities stay the model's own on both sides).
    return SamplingParams(max_tokens=self.max_tokens, temperature=1.0, seed=seed, stop=self.stop, logprobs=True,
                          constraint=self.constraint)

  def _rollout(self) -> tuple[dict, dict]:
    sync = self._sync()
    indices = self._prompt_indices()
    group = self.options.group_size
    first_seed = (self.seed * 1_000_003 + self._drawn * self.batch) % (1 << 31)
    settings = [self.sampling((first_seed + i) % (1 << 31)) for i in range(self.batch)]
    started, hits = time.perf_counter(), self.engine.stats["prefix_cache_hits"]
    numbers = [i for i in indices for _ in range(group)]
    episodes = self._play([self.prompts[i] for i in numbers], [self.rows[i] for i in numbers], numbers, settings,
                          "data.source")
    rollout_s = time.perf_counter() - started
    self._drawn += 1
    scores = self._scores(episodes, [self.rows[i] for i in numbers], numbers, "data.source")
    rewards = np.asarray([s["reward"] for s in scores], np.float32)
    advantages, flat = group_advantages(rewards, group, scale=self.options.loss != "dr_grpo")
    keep = ~flat if self.options.dynamic_sampling else np.ones_like(flat)
    arrays = self._rows(episodes, advantages, keep)
    generated = sum(e.generated for e in episodes)
    metrics = {**sync, "rollout_s": rollout_s, "rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
               "reward_std": float(rewards.std()), "advantage_std": float(advantages.std()),
               "zero_variance_groups": float(flat.reshape(-1, group)[:, 0].mean()),
               "response_length": generated / len(episodes),
               "truncated": float(np.mean([e.finish_reason == "length" for e in episodes])),
               "prefix_cache_hits": float(self.engine.stats["prefix_cache_hits"] - hits)}
    if self.environment is not None:
      metrics["turns"] = float(np.mean([e.turns for e in episodes]))
    for name in scores[0]:
      metrics[name if name == "reward" else f"reward/{name}"] = float(np.mean([s[name] for s in scores]))
    self.last_episodes = episodes
    local = {k: v[self._local] for k, v in arrays.items()}
    batch = _globalize(local, self.sharding, (self.batch, self.seq_len))
    if self.scorer is not None:
      batch, gap = self.scorer(*self._trainer_weights, batch)
      metrics["behaviour_gap"] = float(gap)
      self._zeros = jnp.zeros_like(batch["fresh"])
    return batch, metrics

  def _rows(self, episodes, advantages, keep) -> dict:
    arrays = {k: np.zeros((self.batch, self.seq_len), np.int32 if k in TOKEN_KEYS else np.float32) for k in KEYS}
    arrays["fresh"][:] = float(self.scorer is not None)
    for r, episode in enumerate(episodes):
      tokens = episode.tokens[:self.seq_len + 1]
      n = len(tokens) - 1  # target j is token j + 1
      arrays["inputs"][r, :n] = tokens[:-1]
      arrays["targets"][r, :n] = tokens[1:]
      arrays["segment_ids"][r, :n] = 1
      arrays["positions"][r, :n] = np.arange(n)
      arrays["loss_mask"][r, :n] = np.asarray(episode.sampled[1:n + 1], np.float32) * float(keep[r])
      arrays["behaviour_logprobs"][r, :n] = episode.logprobs[1:n + 1]
      arrays["advantages"][r, :n] = advantages[r]
    return arrays
