"""Multi-turn GRPO (objective.environment): episodes whose observations carry no loss and whose
turns stay on-policy, the environment's rewards summed, the turn cap, the built-in calculator,
observations through a chat template, and bad environments as one-line errors."""

import re

import jax
import numpy as np
import pytest

from jaxpar.data.chat_batches import chat_renderer
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.errors import ConfigError, DataError
from jaxpar.rl.environments import Calculator, Observations, arithmetic, checked_step, load_environment
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config
from tests.test_grpo import _assert_on_policy, _prompts

HERE = __name__  # the environments below, by import path as a config names them


class Votes:
  """Answers each turn with its count; a turn's reward is 1 for "yes"; done after the third."""

  def reset(self, row):
    assert "answer" in row  # the data row's fields reach it
    self.seen = 0

  def step(self, text):
    self.seen += 1
    return f" [{self.seen}]", float(text == "yes"), self.seen == 3


class Endless(Votes):
  def step(self, text):
    return " [more]", 0.5, False


class Raising(Votes):
  def step(self, text):
    raise KeyError("board")


class Untyped(Votes):
  def step(self, text):
    return [" [1]", 1.0, False]


class NoStep:
  def reset(self, row):
    pass


def _trainer(tmp_path, environment, **objective):
  tmp_path.mkdir(exist_ok=True)
  config = small_config(
      mesh={"fsdp": 1}, tmp_path=tmp_path,
      data={"source": _prompts(tmp_path / "prompts.jsonl"), "format": "prompts", "seq_len": 48,
            "global_batch_size": 8},
      train={"objective": "grpo", "steps": 2, "learning_rate": 1e-2, "warmup_steps": 0},
      objective={"group_size": 4, "max_tokens": 4, "environment": f"{HERE}:{environment}",
                 "constraint": {"choice": ["yes", "no"]}, **objective})
  return Trainer(config, devices=jax.devices()[:1])


def test_turns_carry_loss_observations_do_not_and_the_first_ratio_is_one(tmp_path):
  trainer = _trainer(tmp_path, "Votes")
  state = trainer.init_state()
  rollouts = trainer.batches()
  rollouts.follow(state)
  batch = next(rollouts)
  metrics = rollouts.host_metrics()
  mask, targets = np.asarray(batch["loss_mask"]) > 0, np.asarray(batch["targets"])
  decode = rollouts.tokenizer.decode
  for row, episode in enumerate(rollouts.last_episodes):
    assert episode.turns == 3  # the environment said done after the third turn
    start = episode.sampled.index(True)
    transcript = decode(episode.tokens[start:])
    turns = re.fullmatch(r"(yes|no) \[1\](yes|no) \[2\](yes|no)", transcript)
    assert turns, transcript
    assert episode.reward == sum(t == "yes" for t in turns.groups())
    end = len(episode.tokens) - 1
    # The policy's three turns carry loss, the observations between them and the prompt none.
    assert decode(targets[row][mask[row]].tolist()) == "".join(turns.groups())
    assert decode(targets[row, start - 1:end][~mask[row, start - 1:end]].tolist()) == " [1] [2]"
    assert not mask[row, :start - 1].any() and not mask[row, end:].any()
  assert metrics["turns"] == 3.0
  assert metrics["reward/environment"] == pytest.approx(np.mean([e.reward for e in rollouts.last_episodes]))
  assert metrics["reward"] == metrics["reward/environment"]  # no other reward unless given
  _assert_on_policy(trainer, state, batch)  # every turn's recorded log-probs are the trainer's
  _, step = trainer.step(state, batch)
  assert 0 < float(step["ratio_deviation"]) < 1e-6 and np.isfinite(float(step["loss"]))

  # objective.max_turns caps an environment that never ends; bad environments stop the run
  # with one line naming the environment, the row and the turn.
  # Held-out prompts play episodes too (greedy), passing on the environment's reward.
  capped = _trainer(tmp_path / "capped", "Endless", max_turns=2, eval_source=str(tmp_path / "prompts.jsonl"),
                    eval_every=1)
  rollouts = capped.batches()
  rollouts.follow(capped.init_state())
  next(rollouts)
  assert [e.turns for e in rollouts.last_episodes] == [2] * 8
  assert [e.reward for e in rollouts.last_episodes] == [1.0] * 8  # 0.5 a turn: the last turn is scored too
  assert rollouts.host_metrics()["heldout_pass@1"] == 1.0 and rollouts.host_metrics()["heldout_reward"] == 1.0
  for environment, message in ((Raising, r"environment .*:Endless raised KeyError: 'board' on row \d+ of "
                                         r"data.source \(turn 1\)"),
                               (Untyped, r"returned list .* on row \d+ of data.source \(turn 1\): return "
                                         r"\(observation, reward, done\)")):
    rollouts.environment = environment
    with pytest.raises(DataError, match=message) as error:
      next(rollouts)
    assert "\n" not in str(error.value)


def test_environments_that_cannot_work_are_one_line_errors_before_compiling(tmp_path):
  for name, message in ((f"{HERE}:Nowhere", "does not import"), ("calculate", "give a built-in"),
                        (f"{HERE}:NoStep", "makes objects without step")):
    with pytest.raises(ConfigError, match=message):
      load_environment(name)
  with pytest.raises(ConfigError, match="without step"):
    _trainer(tmp_path, "NoStep")
  for result, message in ((("x", float("nan"), False), "reward nan"), ((3, 1.0, True), "int observation"),
                          (({"content": "x"}, 1.0, True), "observation"), (("x", True, False), "reward True")):
    with pytest.raises(DataError, match=message):
      checked_step(result, "env", "row 0")
  assert checked_step(({"role": "tool", "content": "7"}, 1, 0), "env", "row 0") == (
      {"role": "tool", "content": "7"}, 1.0, False)


def test_the_calculator_answers_calls_and_scores_the_final_answer():
  assert arithmetic("(3 + 4) * 2 - 1 / 4") == 13.75
  for bad in ("__import__('os')", "2 ** 10", "1 / 0", "x + 1"):
    with pytest.raises(ValueError):
      arithmetic(bad)
  calculator = Calculator()
  calculator.reset({"answer": 91})
  assert calculator.step("Let me see. <calc>7 * 13</calc>") == ("<result>91</result>", 0.0, False)
  assert calculator.step("<calc>2 ** 3</calc>")[0].startswith("<error>")
  assert calculator.step("So it is 91.") == ("", 1.0, True)
  assert calculator.step("It is 90.") == ("", 0.0, True)
  with pytest.raises(DataError, match="needs an `answer` field"):
    Calculator().reset({"prompt": "hi"})


def test_an_observation_is_what_the_chat_template_writes_after_the_policys_turn(tmp_path):
  config = small_config(data={"chat_template": "chatml", "tokenizer": "byte"})
  tokenizer = ByteTokenizer()
  renderer = chat_renderer(config.data, tokenizer)
  observations = Observations(tokenizer, renderer)
  history = [{"role": "user", "content": "What is 7 times 13?"}]
  tokens = observations.tokens(history, "<calc>7 * 13</calc>", "<result>91</result>")
  # The policy stopped at its end of turn; the rest of the turn's closing, the observation's
  # message and the next generation prompt follow.
  assert tokenizer.decode(tokens) == "\n<|im_start|>user\n<result>91</result><|im_end|>\n<|im_start|>assistant\n"
  tool = observations.tokens(history, "<calc>1+1</calc>", {"role": "tool", "content": "2"})
  assert "tool\n2" in tokenizer.decode(tool)
  assert len(history) == 5  # both turns and both observations, in order
  assert Observations(tokenizer).tokens([], "x", " [1]") == tokenizer.encode(" [1]")
