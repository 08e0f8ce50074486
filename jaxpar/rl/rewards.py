"""Reward functions: a completion's text and its data row -> a float.

`objective.rewards` maps names to weights; a name is a built-in below or an import path
`package.module:function` of any callable `fn(completion: str, row: dict) -> float` (the row
holds every field of the prompt's data row: `answer` and whatever else it carries). The
rollout's reward is the weighted sum. A reward that raises, returns NaN or something not a
number stops the run with one line naming the function and the row.
"""

import importlib
import math
import numbers
import re
from collections.abc import Callable

from jaxpar.errors import ConfigError, DataError

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(text: str) -> str:
  """The answer a completion gives: the last \\boxed{...}, else what follows the last '####'
  (GSM8K's mark), else the last number, else the whole text; stripped, lower-cased, without a
  trailing full stop."""
  if boxed := _BOXED.findall(text):
    answer = boxed[-1]
  elif "####" in text:
    answer = text.rsplit("####", 1)[1]
  elif numbers := _NUMBER.findall(text):
    answer = numbers[-1]
  else:
    answer = text
  return answer.strip().rstrip(".").strip().lower()


def expected_answer(row: dict, name: str) -> str:
  if "answer" not in row:
    raise DataError(f"{name} needs an `answer` field in every data row; this row has {sorted(row)}")
  return str(row["answer"]).strip().rstrip(".").strip().lower()


def exact_answer(completion: str, row: dict) -> float:
  """1 when the completion's final answer equals the row's `answer` (as text), else 0."""
  return float(final_answer(completion) == expected_answer(row, "reward exact_answer"))


def math_equivalence(completion: str, row: dict) -> float:
  """1 when the completion's final answer equals the row's `answer` as mathematics (2/4 and
  0.5, \\frac{1}{2}, 1/2): Hugging Face's `math-verify`, which parses LaTeX and plain
  expressions with sympy and is what open GRPO recipes score MATH and GSM8K with."""
  try:
    from math_verify import parse, verify
  except ImportError:
    raise ConfigError("reward math_equivalence needs math-verify: pip install 'jaxpar[rl]'") from None
  expected, given = parse(str(expected_answer(row, "reward math_equivalence"))), parse(completion)
  return float(bool(expected) and bool(given) and verify(expected, given))


def format_match(pattern: str) -> Callable[[str, dict], float]:
  """1 when the whole completion (stripped) matches `pattern`, else 0."""
  compiled = re.compile(pattern, re.DOTALL)
  return lambda completion, row: float(compiled.fullmatch(completion.strip()) is not None)


def overlong_penalty(max_tokens: int, buffer: int) -> Callable[[str, dict, int], float]:
  """DAPO's soft overlong punishment on the completion's token count: 0 up to
  max_tokens - buffer, then falling linearly to -1 at max_tokens."""
  def penalty(completion: str, row: dict, tokens: int) -> float:
    return min(0.0, (max_tokens - buffer - tokens) / buffer) if buffer else 0.0
  return penalty


BUILT_IN = ("exact_answer", "math_equivalence", "format", "overlong")


def _import(path: str) -> Callable:
  module, _, name = path.partition(":")
  try:
    fn = getattr(importlib.import_module(module), name)
  except (ImportError, AttributeError) as e:
    raise ConfigError(f"objective.rewards: {path!r} does not import ({e}); give a built-in "
                      f"({', '.join(BUILT_IN)}) or package.module:function") from None
  if not callable(fn):
    raise ConfigError(f"objective.rewards: {path} is not callable")
  return fn


class Rewards:
  """The weighted reward functions of `objective.rewards`, resolved once (before compiling)."""

  def __init__(self, weights: dict[str, float], *, format_pattern: str | None, max_tokens: int,
               overlong_buffer: int):
    self.functions: dict[str, tuple[Callable, float, bool]] = {}  # name -> (fn, weight, takes the length)
    for name, weight in weights.items():
      if name == "format":
        if not format_pattern:
          raise ConfigError("objective.rewards has `format` but objective.format_pattern is unset: give the regular "
                            "expression a well-formed completion matches")
        self.functions[name] = (format_match(format_pattern), weight, False)
      elif name == "overlong":
        self.functions[name] = (overlong_penalty(max_tokens, overlong_buffer), weight, True)
      elif name in ("exact_answer", "math_equivalence"):
        self.functions[name] = (globals()[name], weight, False)
        if name == "math_equivalence":
          math_equivalence("0", {"answer": "0"})  # says now if math-verify is missing
      elif ":" in name:
        self.functions[name] = (_import(name), weight, False)
      else:
        raise ConfigError(f"objective.rewards: unknown reward {name!r}; give a built-in "
                          f"({', '.join(BUILT_IN)}) or an import path package.module:function")

  def score(self, completion: str, tokens: int, row: dict, where: str) -> dict[str, float]:
    """{name: value} for one completion, and "reward": their weighted sum. `where` names the
    row in errors."""
    values = {}
    for name, (fn, weight, takes_length) in self.functions.items():
      try:
        value = fn(completion, row, tokens) if takes_length else fn(completion, row)
      except (DataError, ConfigError):
        raise
      except Exception as e:  # a user's function: say whose, and on what
        raise DataError(f"reward {name} raised {type(e).__name__}: {e} on {where}") from e
      if not isinstance(value, numbers.Real):
        raise DataError(f"reward {name} returned {type(value).__name__} {value!r} on {where}: return a float")
      if not math.isfinite(value):
        raise DataError(f"reward {name} returned {value} on {where}: return a finite float")
      values[name] = float(value)
    values["reward"] = sum(values[name] * weight for name, (_, weight, _) in self.functions.items())
    return values
