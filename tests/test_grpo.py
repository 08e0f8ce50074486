"""GRPO and its variants: advantages and losses by hand, rewards and their errors, rollouts
whose recorded log-probs equal the trainer's, weights the engine follows, a step that is the
same on 8 devices as on one, and bad input as one-line errors."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.errors import ConfigError, DataError
from jaxpar.objectives import policy_weights
from jaxpar.objectives.grpo import make_grpo_loss
from jaxpar.objectives.scoring import sequence_logprobs
from jaxpar.rl.losses import group_advantages, policy_loss
from jaxpar.rl.rewards import Rewards, final_answer
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config


def _prompts(path, count=24):
  rng = np.random.default_rng(0)
  with open(path, "w") as f:
    for _ in range(count):
      a, b = (int(x) for x in rng.integers(0, 10, 2))
      # 20 bytes: one whole cache page (16 tokens) that a group's samples share
      f.write(json.dumps({"prompt": f"Compute the sum {a}+{b}=", "answer": str(a + b), "level": int(a > b)}) + "\n")
  return str(path)


def _config(tmp_path, mesh=None, objective=None, rows=None, checkpoint=None, **train):
  source = rows or _prompts(tmp_path / "prompts.jsonl")
  return small_config(mesh=mesh or {"fsdp": 1}, tmp_path=tmp_path, checkpoint=checkpoint,
                      data={"source": source, "format": "prompts", "seq_len": 26, "global_batch_size": 8},
                      train={"objective": "grpo", "steps": 2, "learning_rate": 1e-2, "warmup_steps": 0, **train},
                      objective={"group_size": 4, "max_tokens": 6, "kl_coef": 0.1, **(objective or {})})


# -- by hand ---------------------------------------------------------------------------

def test_group_advantages_by_hand():
  rewards = np.array([1, 0, 0, 1, 2, 2, 2, 2], np.float32)  # two groups of 4; the second all equal
  grpo, flat = group_advantages(rewards, 4, scale=True)
  np.testing.assert_allclose(grpo[:4], np.array([1, -1, -1, 1]) * 0.5 / (0.5 + 1e-4), rtol=1e-6)
  np.testing.assert_array_equal(grpo[4:], 0)
  assert flat.tolist() == [False] * 4 + [True] * 4
  dr, _ = group_advantages(rewards, 4, scale=False)
  np.testing.assert_allclose(dr, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def _toy():
  rng = np.random.default_rng(1)
  mask = np.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0]], np.float32)  # 3, 3 and 1 tokens
  logp = rng.normal(-1, 0.3, mask.shape).astype(np.float32)
  behaviour = logp + rng.normal(0, 0.3, mask.shape).astype(np.float32)
  reference = logp + rng.normal(0, 0.2, mask.shape).astype(np.float32)
  advantages = np.repeat(np.array([[1.0], [-0.5], [2.0]], np.float32), 5, axis=1)
  return logp, behaviour, reference, advantages, mask


def _by_hand(loss, logp, behaviour, reference, advantages, mask, low=0.2, high=0.28, beta=0.1, max_tokens=4):
  """The documented formulas, one token and one row at a time in float64."""
  rows = []
  for i in range(mask.shape[0]):
    tokens = [t for t in range(mask.shape[1]) if mask[i, t]]
    a = float(advantages[i, 0])
    kls = [math.exp(reference[i, t] - logp[i, t]) - (reference[i, t] - logp[i, t]) - 1 for t in tokens]
    if loss == "gspo":
      s = math.exp(sum(logp[i, t] - behaviour[i, t] for t in tokens) / len(tokens))
      rows.append((-min(s * a, min(max(s, 1 - low), 1 + high) * a), kls, tokens))
      continue
    terms = []
    for t in tokens:
      r = math.exp(logp[i, t] - behaviour[i, t])
      terms.append(-min(r * a, min(max(r, 1 - low), 1 + high) * a))
    rows.append((terms, kls, tokens))
  if loss == "gspo":
    return sum(s + beta * sum(k) / len(k) for s, k, _ in rows) / len(rows)
  if loss == "grpo":
    return sum(sum(t) / len(t) + beta * sum(k) / len(k) for t, k, _ in rows) / len(rows)
  if loss == "dr_grpo":
    return sum(sum(t) + beta * sum(k) for t, k, _ in rows) / (len(rows) * max_tokens)
  count = sum(len(tok) for _, _, tok in rows)  # dapo: every token weighs the same
  return sum(sum(t) + beta * sum(k) for t, k, _ in rows) / count


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_each_loss_variant_by_hand(loss):
  logp, behaviour, reference, advantages, mask = _toy()
  total, metrics, unit = policy_loss(jnp.asarray(logp), behaviour, advantages, mask, loss=loss, clip_low=0.2,
                                     clip_high=0.28, max_tokens=4, reference=jnp.asarray(reference), kl_coef=0.1)
  expected = _by_hand(loss, logp, behaviour, reference, advantages, mask)
  assert float(total / unit) == pytest.approx(expected, rel=1e-5)
  assert 0 <= float(metrics["clip_fraction"] / unit) <= 1


def test_prompt_and_padding_tokens_carry_no_loss():
  logp, behaviour, reference, advantages, mask = _toy()
  noisy = np.where(mask > 0, logp, logp + 5.0)  # anything may sit where the mask is 0
  for loss in ("grpo", "dapo", "gspo"):
    kwargs = dict(loss=loss, clip_low=0.2, clip_high=0.2, max_tokens=4, reference=jnp.asarray(reference), kl_coef=0.1)
    a = policy_loss(jnp.asarray(logp), behaviour, advantages, mask, **kwargs)[0]
    b = policy_loss(jnp.asarray(noisy), np.where(mask > 0, behaviour, 0.0), advantages, mask, **kwargs)[0]
    assert float(a) == float(b)
    grad = jax.grad(lambda x: policy_loss(x, behaviour, advantages, mask, **kwargs)[0])(jnp.asarray(logp))
    assert np.all(np.asarray(grad)[mask == 0] == 0) and np.any(np.asarray(grad)[mask > 0] != 0)


# -- rewards ---------------------------------------------------------------------------

def bad_raises(completion, row):
  raise KeyError("score")


def bad_nan(completion, row):
  return float("nan")


def bad_type(completion, row):
  return "1"


def by_level(completion, row):
  return float(row["level"])


def test_built_in_rewards_and_weights():
  assert final_answer("4 plus 8 is 12.") == "12"
  assert final_answer("so \\boxed{7} it is, 9") == "7"
  assert final_answer("steps 3 4 #### 42") == "42"
  rewards = Rewards({"exact_answer": 1.0, "format": 0.5, "overlong": 1.0, "tests.test_grpo:by_level": 2.0},
                    format_pattern=r"\d+ plus \d+ is \d+\.", max_tokens=10, overlong_buffer=4)
  scores = rewards.score("4 plus 8 is 12.", 8, {"answer": "12", "level": 1}, "row 0")
  assert scores == {"exact_answer": 1.0, "format": 1.0, "overlong": -0.5, "tests.test_grpo:by_level": 1.0,
                    "reward": 1.0 + 0.5 - 0.5 + 2.0}
  assert rewards.score("it is 13", 3, {"answer": "12", "level": 0}, "row 0")["reward"] == 0.0


def test_math_equivalence_reward():
  rewards = Rewards({"math_equivalence": 1.0}, format_pattern=None, max_tokens=8, overlong_buffer=0)
  assert rewards.score("the answer is $\\frac{1}{2}$", 5, {"answer": "0.5"}, "row 0")["reward"] == 1.0
  assert rewards.score("the answer is $\\frac{1}{3}$", 5, {"answer": "0.5"}, "row 0")["reward"] == 0.0


@pytest.mark.parametrize("name, message", [
    ("tests.test_grpo:bad_raises", "reward tests.test_grpo:bad_raises raised KeyError: 'score' on row 3"),
    ("tests.test_grpo:bad_nan", "reward tests.test_grpo:bad_nan returned nan on row 3: return a finite float"),
    ("tests.test_grpo:bad_type", "reward tests.test_grpo:bad_type returned str '1' on row 3: return a float")])
def test_a_bad_reward_is_one_line_naming_it_and_the_row(name, message):
  rewards = Rewards({name: 1.0}, format_pattern=None, max_tokens=8, overlong_buffer=0)
  with pytest.raises(DataError) as error:
    rewards.score("1", 1, {"answer": "1"}, "row 3")
  assert str(error.value) == message


def test_reward_names_that_cannot_work_fail_before_compiling():
  with pytest.raises(ConfigError, match="'nowhere.at_all:f' does not import"):
    Rewards({"nowhere.at_all:f": 1.0}, format_pattern=None, max_tokens=8, overlong_buffer=0)
  with pytest.raises(ConfigError, match="unknown reward 'exact'"):
    Rewards({"exact": 1.0}, format_pattern=None, max_tokens=8, overlong_buffer=0)
  with pytest.raises(ConfigError, match="objective.format_pattern is unset"):
    Rewards({"format": 1.0}, format_pattern=None, max_tokens=8, overlong_buffer=0)
  with pytest.raises(DataError, match="needs an `answer` field"):
    Rewards({"exact_answer": 1.0}, format_pattern=None, max_tokens=8, overlong_buffer=0).score("1", 1, {}, "row 0")


# -- rollouts, the engine and the trainer ----------------------------------------------

def _host(tree):
  return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """A trainer on one device, its fresh state, and its first rollout batch."""
  trainer = Trainer(_config(tmp_path_factory.mktemp("grpo")), devices=jax.devices()[:1])
  state = trainer.init_state()
  rollouts = trainer.batches()
  rollouts.follow(state)
  batch = next(rollouts)
  return trainer, state, rollouts, batch, list(rollouts.last_episodes)


def _trainer_logprobs(trainer, state, batch):
  weights = policy_weights(state.params, state.frozen)
  with trainer.context():
    return jax.jit(lambda w, s, b: sequence_logprobs(nnx.merge(trainer.graphdef, w, s), b)[0])(
        weights, state.model_state, batch)


def _assert_on_policy(trainer, state, batch):
  mask = np.asarray(batch["loss_mask"]) > 0
  assert mask.sum() >= 8  # completions were sampled and carry loss
  recorded = np.asarray(batch["behaviour_logprobs"])[mask]
  recomputed = np.asarray(_trainer_logprobs(trainer, state, batch))[mask]
  assert np.all(np.isfinite(recorded)) and np.all(recorded < 0)
  # Equal up to float32 rounding: decoding one token at a time sums in another order than the
  # whole-sequence forward (measured: at most 4 ulps, 1.9e-6 at |log p| = 6.2).
  np.testing.assert_allclose(recorded, recomputed, rtol=1e-6, atol=0)


def test_the_engines_logprobs_equal_the_trainers_and_the_first_ratio_is_one(one_device):
  trainer, state, rollouts, batch, _ = one_device
  _assert_on_policy(trainer, state, batch)
  metrics = rollouts.host_metrics()
  assert metrics["prefix_cache_hits"] > 0  # a group's samples share their prompt's pages
  assert metrics["sync_bytes"] == 0  # collocated: the engine reads the trainer's arrays
  before = _host(state.params)
  new_state, step = trainer.step(state, batch)
  assert 0 < float(step["ratio_deviation"]) < 1e-6  # float rounding alone
  assert abs(float(step["kl"])) < 1e-7  # the policy is still the reference
  assert float(step["clip_fraction"]) == 0.0
  # The next rollout samples from the updated weights: the engine holds them, not the old ones.
  rollouts.follow(new_state)
  next_batch = next(rollouts)
  held = jax.tree.leaves(_host(rollouts.engine.params))
  assert all(np.array_equal(a, b) for a, b in zip(held, jax.tree.leaves(_host(new_state.params))))
  assert not all(np.array_equal(a, b) for a, b in zip(held, jax.tree.leaves(before)))
  _assert_on_policy(trainer, new_state, next_batch)


def test_scoring_in_chunks_equals_the_whole_sequence_and_its_gradients(one_device):
  """train.logits_chunk_len: the logits a chunk at a time, remade in the backward pass, give the
  whole-sequence forward's log-probs, entropies and gradients."""
  trainer, state, _, batch, _ = one_device
  weights = policy_weights(state.params, state.frozen)

  def scored(chunk_len):
    def total(w):
      logp, spread = sequence_logprobs(nnx.merge(trainer.graphdef, w, state.model_state), batch, chunk_len)
      return jnp.sum(logp * batch["loss_mask"]), (logp, spread)
    with trainer.context():
      return _host(jax.jit(jax.grad(total, has_aux=True))(weights))
  (whole_grads, (whole, whole_spread)), (grads, (chunked, spread)) = scored(0), scored(13)  # 26 = 2 x 13
  np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(spread, whole_spread, rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(whole_grads), jax.tree.leaves(grads)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_rollouts_under_a_constraint_follow_it_and_stay_on_policy(tmp_path):
  """objective.constraint: every completion (and held-out answer) is what the regex allows;
  the recorded log-probs are the model's own, which the trainer's recomputation equals, so
  the first ratio is 1. A constraint that cannot work is one line before anything compiles."""
  pattern = "[0-9]{1,2}"
  config = _config(tmp_path, objective={"constraint": {"regex": pattern}})
  trainer = Trainer(config, devices=jax.devices()[:1])
  state = trainer.init_state()
  rollouts = trainer.batches()
  rollouts.follow(state)
  batch = next(rollouts)
  texts = [e.text for e in rollouts.last_episodes]
  assert all(re.fullmatch(pattern, text) for text in texts), texts
  (tmp_path / "free").mkdir()
  (tmp_path / "bad").mkdir()
  unconstrained = Trainer(_config(tmp_path / "free"), devices=jax.devices()[:1]).batches()
  unconstrained.follow(state)
  next(unconstrained)
  assert not all(re.fullmatch(pattern, e.text) for e in unconstrained.last_episodes)  # it did constrain
  _assert_on_policy(trainer, state, batch)
  _, step = trainer.step(state, batch)
  assert 0 <= float(step["ratio_deviation"]) < 1e-6
  for spec, message in (({"regex": "("}, "objective.constraint.regex"), ({"yaml": "x"}, "give one of regex")):
    with pytest.raises(ConfigError, match=message) as error:
      Trainer(_config(tmp_path / "bad", objective={"constraint": spec}), devices=jax.devices()[:1]).batches()
    assert "\n" not in str(error.value)


def test_behaviour_from_the_trainer_makes_the_first_ratio_exactly_one(tmp_path):
  """objective.behaviour=trainer, two updates per rollout batch: the first divides by its own
  forward (ratio exactly 1), the second reuses the batch and divides by the scored forward."""
  config = _config(tmp_path, objective={"behaviour": "trainer", "inner_steps": 2})
  trainer = Trainer(config, devices=jax.devices()[:1])
  state = trainer.init_state()
  rollouts = trainer.batches()
  rollouts.follow(state)
  batch = next(rollouts)
  mask = np.asarray(batch["loss_mask"]) > 0
  scored = np.asarray(_trainer_logprobs(trainer, state, batch))
  np.testing.assert_array_equal(np.asarray(batch["behaviour_logprobs"])[mask], scored[mask])
  assert 0 <= rollouts.host_metrics()["behaviour_gap"] < 1e-5
  state, step = trainer.step(state, batch)
  assert float(step["ratio_deviation"]) == 0.0 and float(step["clip_fraction"]) == 0.0
  rollouts.follow(state)
  again = next(rollouts)
  assert np.array_equal(np.asarray(again["inputs"]), np.asarray(batch["inputs"]))  # the same rollouts
  assert not np.asarray(again["fresh"]).any() and "reward" not in rollouts.host_metrics()
  _, step = trainer.step(state, again)
  assert float(step["ratio_deviation"]) > 1e-4  # the policy moved away from the behaviour


def test_rollouts_lay_out_prompt_completion_and_rewards(one_device):
  trainer, _, rollouts, batch, episodes = one_device
  mask, inputs = np.asarray(batch["loss_mask"]), np.asarray(batch["inputs"])
  targets = np.asarray(batch["targets"])
  for row, episode in enumerate(episodes):
    start = episode.sampled.index(True)
    prompt, sampled = episode.tokens[:start], episode.tokens[start:]
    assert prompt in rollouts.prompts and all(episode.sampled[start:]) and len(sampled) == episode.generated
    assert rollouts.tokenizer.decode(sampled).startswith(episode.text)  # the completion, its stop token after
    assert inputs[row, :len(prompt)].tolist() == prompt
    assert mask[row, :len(prompt) - 1].sum() == 0  # the prompt's own tokens carry no loss
    assert targets[row, len(prompt) - 1:len(prompt) - 1 + len(sampled)].tolist() == sampled
    assert mask[row, len(prompt) - 1:len(prompt) - 1 + len(sampled)].all()
    assert mask[row, len(prompt) - 1 + len(sampled):].sum() == 0  # nor does the padding
  advantages = np.asarray(batch["advantages"])[:, 0].reshape(-1, 4)
  np.testing.assert_allclose(advantages.sum(axis=1), 0, atol=1e-4)  # relative to each group


def test_an_rl_step_on_fsdp4_tensor2_equals_one_device(one_device, tmp_path):
  batch = _host(one_device[3])
  results = []
  for devices, mesh in ((jax.devices()[:1], {"fsdp": 1}), (jax.devices(), {"fsdp": 4, "tensor": 2})):
    other = Trainer(_config(tmp_path, mesh=mesh), devices=devices)
    state = other.init_state()
    gradients = make_gradients(make_grpo_loss(other.graphdef, other.config.objective, reference_kept=True),
                               microbatches=1)
    placed = {k: jax.device_put(v, other.batch_sharding) for k, v in batch.items()}
    with other.context():
      grads, sums, _ = jax.jit(gradients)(state.params, placed, state.model_state, state.frozen)
    results.append(_host((grads, sums)))
  (grads1, sums1), (grads8, sums8) = results
  assert float(sums8["ce_sum"]) == pytest.approx(float(sums1["ce_sum"]), rel=1e-5, abs=1e-7)
  for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads8)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_bad_prompts_and_settings_are_one_line_errors(tmp_path):
  long = tmp_path / "long.jsonl"
  long.write_text(json.dumps({"prompt": "x" * 22, "answer": "1"}) + "\n")
  with pytest.raises(DataError, match=r"row 0 .* its prompt has 22 tokens, and with objective.max_tokens=6"):
    Trainer(_config(tmp_path, rows=str(long)), devices=jax.devices()[:1]).batches()
  missing = tmp_path / "missing.jsonl"
  missing.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
  with pytest.raises(DataError, match="row 0 .* has no `prompt` field"):
    Trainer(_config(tmp_path, rows=str(missing)), devices=jax.devices()[:1]).batches()
  with pytest.raises(ConfigError, match="not a multiple of objective.group_size=3"):
    Trainer(_config(tmp_path, objective={"group_size": 3}), devices=jax.devices()[:1])
  with pytest.raises(ConfigError, match="does not import"):
    Trainer(_config(tmp_path, objective={"rewards": {"no_such_module:f": 1.0}}), devices=jax.devices()[:1])


def test_split_rollouts_get_the_weights_device_to_device_and_lora_moves_only_adapters(tmp_path):
  """Rollouts on devices 0-3, training on 4-7: on-policy across the two meshes, the engine
  holds the trainer's weights after each update, and under LoRA only the adapters move."""
  lora = {"rank": 4, "alpha": 8.0, "targets": ["q", "v", "down"]}
  config = small_config(mesh={"fsdp": -1}, model={"lora": lora}, tmp_path=tmp_path,
                        data={"source": _prompts(tmp_path / "prompts.jsonl"), "format": "prompts", "seq_len": 26,
                              "global_batch_size": 8},
                        train={"objective": "grpo", "steps": 2, "learning_rate": 1e-2, "warmup_steps": 0},
                        objective={"group_size": 4, "max_tokens": 6, "rollout_devices": 4})
  trainer = Trainer(config, devices=jax.devices())
  assert set(trainer.mesh.devices.flat) == set(jax.devices()[4:])
  state = trainer.init_state()
  rollouts = trainer.batches()
  rollouts.follow(state)
  batch = next(rollouts)
  assert set(rollouts.engine.runtime.mesh.devices.flat) == set(jax.devices()[:4])
  _assert_on_policy(trainer, state, batch)
  whole = sum(x.nbytes for x in jax.tree.leaves(policy_weights(state.params, state.frozen)))
  assert rollouts.host_metrics()["sync_bytes"] == whole  # the first sync: every weight
  state, _ = trainer.step(state, batch)
  rollouts.follow(state)
  next(rollouts)
  adapters = sum(x.nbytes for x in jax.tree.leaves(state.params))
  assert rollouts.host_metrics()["sync_bytes"] == adapters < whole / 4
  held = _host(rollouts.engine.params)
  for a, b in zip(jax.tree.leaves(held), jax.tree.leaves(_host(policy_weights(state.params, state.frozen)))):
    assert np.array_equal(a, b)


def test_off_policy_rollouts_run_ahead_within_the_staleness_bound(tmp_path):
  config = _config(tmp_path, mesh={"fsdp": -1}, objective={"rollout_devices": 4, "max_staleness": 1, "kl_coef": 0},
                   steps=4)
  result = Trainer(config, devices=jax.devices()).fit(show_progress=False)
  staleness = [h["staleness"] for h in result.history]
  assert max(staleness) <= 1 and staleness[0] == 0 and 1 in staleness[1:]
  assert all(np.isfinite(h["loss"]) for h in result.history)
  with pytest.raises(ConfigError, match="give them devices of their own"):
    Trainer(_config(tmp_path, objective={"max_staleness": 1}), devices=jax.devices()[:1])


def test_a_resumed_rl_run_takes_the_same_next_steps(tmp_path):
  """4 steps straight, against 2 steps and a resume to 4: the checkpoint holds the rollout
  state (the next prompt, the rollouts drawn), so steps 3 and 4 sample the same completions
  and take the same updates."""
  def run(name, steps):
    (tmp_path / name).mkdir(exist_ok=True)
    # A constant schedule: the learning rate of steps 1-2 must not depend on train.steps.
    config = _config(tmp_path / name, steps=steps, log_every=1, schedule="constant", checkpoint={"every_steps": 2})
    return Trainer(config, devices=jax.devices()[:1]).fit(show_progress=False).history
  straight = run("straight", 4)
  run("resumed", 2)
  resumed = run("resumed", 4)
  assert [h["step"] for h in resumed] == [3, 4]
  for key in ("loss", "reward", "response_length", "grad_norm"):
    assert [h[key] for h in resumed] == [h[key] for h in straight[2:]], key
