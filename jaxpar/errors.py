"""What a user can fix, told apart from jaxpar's own bugs.

Every exception here is a `UserError`: its message is one line naming the problem and the
fix, and the CLI prints it as such (exit code 2). Anything else that escapes is a bug, and
the CLI says so (exit code 1, with the traceback's last frames). They subclass ValueError
so that code catching ValueError around a bad input keeps working.

This module imports nothing of jaxpar: models/, mesh/ and pallas_kernels/ raise these too.
"""

import difflib


def did_you_mean(word: str, choices, prefix: str = "") -> str:
  """The hint `: did you mean 'X'?` for the nearest choice (shown after `prefix`); "" when
  none is near."""
  near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
  return f": did you mean {prefix + near[0]!r}?" if near else ""


class UserError(ValueError):
  """A problem in what the user gave (a config, a path, a file, a request); one line."""


class ConfigError(UserError):
  """A config key, value or combination that cannot work."""


class CheckpointError(UserError):
  """A checkpoint that is missing, incomplete, or written for another model."""


class DataError(UserError):
  """A data source or tokenizer that cannot be read as given."""
