"""Execution choices that per-device code reads from the surrounding context, as it reads the
logical rules: the runtime sets them once from the parallel plan (jaxpar/parallel.py), so a
model never carries a parallelism option.

They are read while a function is traced: trace inside the context that sets them.
"""

import contextlib
import contextvars
import dataclasses


@dataclasses.dataclass(frozen=True)
class ExecutionOptions:
  context_attention: str = "all_gather"  # how attention crosses the devices that split `length`


_CURRENT = contextvars.ContextVar("jaxpar_execution_options", default=ExecutionOptions())


@contextlib.contextmanager
def execution_options(options: ExecutionOptions):
  token = _CURRENT.set(options)
  try:
    yield options
  finally:
    _CURRENT.reset(token)


def current_execution_options() -> ExecutionOptions:
  return _CURRENT.get()
