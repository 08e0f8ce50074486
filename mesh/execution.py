"""Execution choices that per-device code reads from the surrounding context, as it reads the
logical rules: the runtime sets them once from the parallel plan (jaxpar/parallel.py), so a
model never carries a parallelism option.

They are read while a function is traced: trace inside the context that sets them.
"""

import contextlib
import contextvars
import dataclasses


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
  """How the repeated layer group runs over the pipeline stages (models/pipeline.py).

  stages x repeats groups of layers; the group is stored stage-major (stage s holds the
  layers it runs in every repeat, contiguously), so its stacked axis splits over `axis`.
  bubble_fill: what the bubble iterations' inputs hold before they are masked (tests fill
  them with NaN so that any leak shows).
  """
  stages: int
  microbatches: int
  repeats: int = 1
  axis: str = "stage"  # the mesh axis the stages live on
  bubble_fill: float = 0.0


@dataclasses.dataclass(frozen=True)
class ExecutionOptions:
  context_attention: str = "all_gather"  # how attention crosses the devices that split `length`
  pipeline: PipelineOptions | None = None  # None: the layer groups run as one scan each


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
