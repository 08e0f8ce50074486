"""Long compiles in named phases. A phase is a context manager factory, `phase(name)`:
the library's default says nothing; `Phases(console)` shows a spinner with the elapsed time
while each phase runs (a terminal or a notebook) and one line with its duration when it
ends, so a 10-minute compile for a pod is never a silent screen."""

import contextlib
import time

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from jaxpar.aot.report import seconds


@contextlib.contextmanager
def silent(name: str):
  yield


class Phases:
  """`with phases("lowering the train step"): ...` -> a live spinner, then
  `lowering the train step: 1.23 s`."""

  def __init__(self, console: Console | None = None):
    self.console = console or Console()

  @contextlib.contextmanager
  def __call__(self, name: str):
    started = time.perf_counter()
    if self.console.is_terminal or self.console.is_jupyter:  # elsewhere (a log file) a spinner is noise
      spinner = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                         console=self.console, transient=True)
      with spinner:
        spinner.add_task(name, total=None)
        yield
    else:
      yield
    self.console.print(f"{name}: {seconds(time.perf_counter() - started)}", markup=False, highlight=False)
