"""Multi-turn episodes (objective.environment): the policy talks with an environment, a tool or
a game, for up to objective.max_turns turns, and is trained on its own turns only.

An environment is a class (or any callable returning a fresh object) with two methods:

    reset(row: dict) -> None            # a new episode on this data row (its prompt is the first turn's)
    step(text: str) -> (observation, reward, done)

`step` gets each policy turn's text (the stop string cut off) and returns what the policy sees
next (a string, said as the user, or a chat message {"role": ..., "content": ...}), a float
reward for that turn, and whether the episode is over. One object plays one episode. The
episode's environment reward is the sum over its turns (`reward/environment`); the reward
functions of objective.rewards, if any, score the last turn's text and add to it.

The transcript is one sequence: the prompt, then each turn's sampled tokens (loss, with the
log-probabilities the engine recorded) and the observation's tokens after it (no loss: the
policy did not choose them). With a chat template the observation is what the template writes
after the policy's end of turn: the rest of that turn's closing, the observation's message
and the generation prompt. Without one, the observation's text goes in as it is.

An episode ends when the environment says done, at objective.max_turns, when a turn is cut
at objective.max_tokens (the environment does not see a turn that did not end), or when the
next observation and a token would not fit in data.seq_len.
"""

import ast
import dataclasses
import importlib
import math
import numbers
import operator
import re

from jaxpar.errors import ConfigError, DataError
from jaxpar.rl.rewards import expected_answer, final_answer

PROTOCOL = "a class with reset(row) and step(text) -> (observation, reward, done)"


@dataclasses.dataclass
class Episode:
  """One transcript: tokens with, per token, whether the policy sampled it and its recorded
  log-probability (0 where it did not sample it)."""
  tokens: list[int]
  sampled: list[bool]
  logprobs: list[float]
  text: str = ""  # the last turn's text: what the reward functions score
  generated: int = 0  # tokens the policy sampled, over every turn
  reward: float = 0.0  # the environment's rewards, summed
  turns: int = 0
  finish_reason: str | None = None  # the last turn's

  @classmethod
  def start(cls, prompt: list[int]) -> "Episode":
    return cls(list(prompt), [False] * len(prompt), [0.0] * len(prompt))

  def add_turn(self, completion):
    """A completion of this transcript: its tokens and the stop token that ended it (the policy
    sampled that too)."""
    sampled = completion.tokens + ([completion.stop_token[0]] if completion.stop_token else [])
    logprobs = (completion.logprobs or [0.0] * len(completion.tokens)) + \
        ([completion.stop_token[1]] if completion.stop_token else [])
    self.tokens += sampled
    self.sampled += [True] * len(sampled)
    self.logprobs += [0.0 if math.isnan(p) else p for p in logprobs]
    self.text, self.finish_reason = completion.text, completion.finish_reason
    self.generated += len(sampled)
    self.turns += 1

  def add_observation(self, tokens: list[int]):
    self.tokens += tokens
    self.sampled += [False] * len(tokens)
    self.logprobs += [0.0] * len(tokens)


# -- the built-in environment ----------------------------------------------------------

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def arithmetic(expression: str) -> float:
  """The value of numbers joined by + - * / and parentheses; ValueError for anything else."""
  def value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
      return _OPERATORS[type(node.op)](value(node.left), value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
      return _OPERATORS[type(node.op)](value(node.operand))
    raise ValueError("only numbers, + - * / and parentheses")
  try:
    return value(ast.parse(expression.strip(), mode="eval").body)
  except (SyntaxError, ZeroDivisionError) as e:
    raise ValueError(str(e)) from None


class Calculator:
  """A tool: a turn holding `<calc>EXPRESSION</calc>` gets `<result>VALUE</result>` back (or
  `<error>...</error>`); a turn without a call is the final answer, rewarded 1 when its final
  answer (rewards.final_answer) equals the row's `answer`, and ends the episode."""

  def reset(self, row: dict):
    self.answer = expected_answer(row, "environment calculator")

  def step(self, text: str):
    call = _CALL.search(text)
    if call is None:
      return "", float(final_answer(text) == self.answer), True
    try:
      result = arithmetic(call.group(1))
    except ValueError as e:
      return f"<error>{e}</error>", 0.0, False
    return f"<result>{int(result) if float(result).is_integer() else round(result, 6)}</result>", 0.0, False


BUILT_IN = {"calculator": Calculator}


def load_environment(name: str):
  """objective.environment (a built-in name or package.module:Class) -> a factory of fresh
  environments, checked to make objects with reset and step; a one-line ConfigError if not."""
  if name in BUILT_IN:
    return BUILT_IN[name]
  module, _, attribute = name.partition(":")
  if not attribute:
    raise ConfigError(f"objective.environment={name!r}: give a built-in ({', '.join(BUILT_IN)}) or "
                      "package.module:Class")
  try:
    factory = getattr(importlib.import_module(module), attribute)
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"objective.environment: {name!r} does not import ({e}); give a built-in "
                      f"({', '.join(BUILT_IN)}) or package.module:Class") from None
  try:
    probe = factory()
  except Exception as e:
    raise ConfigError(f"objective.environment: {name}() raised {type(e).__name__}: {e}; it must build a "
                      "fresh environment with no arguments") from None
  missing = [m for m in ("reset", "step") if not callable(getattr(probe, m, None))]
  if missing:
    raise ConfigError(f"objective.environment: {name} makes objects without {' or '.join(missing)}: give "
                      f"{PROTOCOL}")
  return factory


def checked_step(result, name: str, where: str) -> tuple[str | dict, float, bool]:
  """An environment's step result, or a one-line DataError naming it and the row."""
  if not (isinstance(result, tuple) and len(result) == 3):
    raise DataError(f"environment {name} returned {type(result).__name__} {result!r:.80} on {where}: return "
                    "(observation, reward, done)")
  observation, reward, done = result
  if isinstance(observation, dict):
    if not isinstance(observation.get("role"), str) or not isinstance(observation.get("content"), str):
      raise DataError(f"environment {name} returned the observation {observation!r:.80} on {where}: give a "
                      "string or a message {\"role\": ..., \"content\": ...}")
  elif not isinstance(observation, str):
    raise DataError(f"environment {name} returned a {type(observation).__name__} observation on {where}: give "
                    "a string or a message {\"role\": ..., \"content\": ...}")
  if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or not math.isfinite(reward):
    raise DataError(f"environment {name} returned the reward {reward!r} on {where}: return a finite float")
  return observation, float(reward), bool(done)


class Observations:
  """Observations as tokens: with a chat renderer, what the template writes after the policy's
  end of turn up to the next generation prompt; without one, the text as it is."""

  def __init__(self, tokenizer, renderer=None):
    self.tokenizer, self.renderer = tokenizer, renderer
    self.end_of_turn = renderer.end_of_turn() if renderer is not None else ""

  def tokens(self, history: list[dict], turn: str, observation: str | dict) -> list[int]:
    """`history` (the conversation so far, as messages) gains the policy's `turn` and the
    observation; returns the observation's tokens."""
    message = observation if isinstance(observation, dict) else {"role": "user", "content": observation}
    history.append({"role": "assistant", "content": turn})
    history.append(message)
    if self.renderer is None:
      return self.tokenizer.encode(message["content"])
    before = self.renderer.render(history[:-1], add_generation_prompt=False)
    after = self.renderer.render(history, add_generation_prompt=True)
    if not after.startswith(before):
      raise DataError("the chat template writes earlier turns differently once an observation follows them: "
                      "multi-turn episodes need a template that only appends")
    closing = before[before.rindex(self.end_of_turn) + len(self.end_of_turn):] if self.end_of_turn in before else ""
    return self.tokenizer.encode(closing + after[len(before):])
