"""Join a multi-process job on JAX's own runtime (`jax.distributed`).

Where a process learns who its peers are, first match wins:

1. options: `--coordinator HOST:PORT --num-processes N --process-id I` (Python: the same
   keywords of `initialize`);
2. environment: `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` (what
   `jaxpar launch-local`, a Kubernetes manifest or a job script sets);
3. what `jax.distributed.initialize()` detects by itself: Cloud TPU VMs (and GKE TPU pods),
   SLURM, Open MPI.

Otherwise the job is one process and nothing starts. JAX's runtime aborts with a C++ stack
trace when peers never show up or die; here a timer reports the first case as one line
naming the fix, and `peers.PeerWatch` the second, before JAX's own (longer) timeouts fire.
"""

import atexit
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, fields

from jaxpar.cluster.peers import PeerWatch  # jax itself is imported on use: the CLI's --help stays fast
from jaxpar.errors import UserError

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}
EXIT_PEER_FAILURE = 1  # the job failed because of another process (or never formed)
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclass(frozen=True)
class DistributedOptions:
  coordinator: str | None = None   # HOST:PORT of process 0
  num_processes: int | None = None
  process_id: int | None = None
  init_timeout: float = 300.0      # seconds for every process to join
  peer_timeout: float = 60.0       # seconds without a peer's heartbeat before the job stops


_identity: tuple[int, int] | None = None  # (process id, number of processes) once known
_watch: PeerWatch | None = None


def add_distributed_args(parser):
  """The multi-process options, for any subcommand that runs a model (`train`, `compile`,
  `generate`, `serve`). `jaxpar.cli.main` joins the job before the subcommand runs whenever
  its parser has them."""
  group = parser.add_argument_group(
      "multi-process", "Join a jax.distributed job. Default: the JAX_* environment variables, "
      "else what JAX detects (TPU VM, SLURM, Open MPI), else one process.")
  group.add_argument("--coordinator", metavar="HOST:PORT",
                     help=f"address of process 0 (env {ENV['coordinator']})")
  group.add_argument("--num-processes", type=int, metavar="N",
                     help=f"processes in the job (env {ENV['num_processes']})")
  group.add_argument("--process-id", type=int, metavar="I",
                     help=f"this process, 0..N-1 (env {ENV['process_id']})")
  group.add_argument("--init-timeout", type=float, default=DistributedOptions.init_timeout,
                     metavar="S", help="seconds for all processes to join (default %(default)g)")
  group.add_argument("--peer-timeout", type=float, default=DistributedOptions.peer_timeout,
                     metavar="S", help="seconds without a heartbeat before a process counts as "
                     "dead and the job stops (default %(default)g)")


def options_from_args(ns) -> DistributedOptions:
  return DistributedOptions(**{f.name: getattr(ns, f.name) for f in fields(DistributedOptions)})


def _from_env(options: DistributedOptions) -> DistributedOptions:
  values = {}
  for name, var in ENV.items():
    value = getattr(options, name)
    if value is None and os.environ.get(var):
      raw = os.environ[var]
      if name != "coordinator" and not raw.lstrip("-").isdigit():
        raise UserError(f"{var}={raw!r} is not an integer")
      value = raw if name == "coordinator" else int(raw)
    values[name] = value
  return DistributedOptions(**{**options.__dict__, **values})


def _check(options: DistributedOptions):
  if not _ADDRESS.match(options.coordinator):
    raise UserError(f"--coordinator={options.coordinator!r} is not HOST:PORT (e.g. 10.0.0.2:8476)")
  if options.num_processes < 1:
    raise UserError(f"--num-processes={options.num_processes} must be >= 1")
  if not 0 <= options.process_id < options.num_processes:
    raise UserError(f"--process-id={options.process_id} must be in 0..{options.num_processes - 1} "
                     f"(--num-processes={options.num_processes})")
  for name in ("init_timeout", "peer_timeout"):
    if getattr(options, name) <= 0:
      raise UserError(f"--{name.replace('_', '-')}={getattr(options, name)} must be > 0 seconds")


def _cluster_detected() -> bool:
  """Whether jax.distributed would find its peers by itself (TPU VM, SLURM, Open MPI, ...)."""
  from jax._src import clusters  # the same detection jax.distributed.initialize() runs
  return any(not env.opt_in_only_method and env.is_env_present()
             for env in clusters.ClusterEnv._cluster_types)  # noqa: SLF001


def initialize(options: DistributedOptions | None = None, **kwargs) -> bool:
  """Join the job if there is one (see the module doc); returns whether this process is part
  of a jax.distributed job. Call before anything touches a JAX device. Safe to call twice.

      jaxpar.cluster.distributed.initialize(coordinator="10.0.0.2:8476", num_processes=4, process_id=i)
  """
  global _identity, _watch
  import jax
  options = DistributedOptions(**{**(options or DistributedOptions()).__dict__, **kwargs})
  if jax.distributed.is_initialized():
    return True
  options = _from_env(options)
  missing = [name for name in ENV if getattr(options, name) is None]
  if not missing:
    _check(options)
    _identity = (options.process_id, options.num_processes)
  elif not _cluster_detected():  # a detected cluster fills in what is missing
    if len(missing) < len(ENV):
      raise UserError(f"--{missing[0].replace('_', '-')} is missing (env {ENV[missing[0]]}): give "
                       "--coordinator HOST:PORT, --num-processes N and --process-id I together, "
                       "or none of them")
    return False
  from jax._src import xla_bridge
  if xla_bridge.backends_are_initialized():
    raise UserError("jax.distributed must start before JAX uses any device: call "
                     "jaxpar.cluster.distributed.initialize() first thing in the program")
  where = options.coordinator or "the address JAX detected"
  timer = threading.Timer(options.init_timeout, abort, args=(
      f"the job did not form within --init-timeout={options.init_timeout:g} s (coordinator {where}, "
      f"{options.num_processes or 'detected'} processes): start every process with the same "
      "--coordinator and --num-processes and its own --process-id, or raise --init-timeout",))
  timer.daemon = True
  timer.start()
  # jaxpar agrees on a stop step itself (preemption.py); JAX's service would also take SIGTERM.
  jax.config.update("jax_enable_preemption_service", False)
  try:
    # JAX's own timeouts are longer than ours, so the one-line reports come first.
    jax.distributed.initialize(options.coordinator, options.num_processes, options.process_id,
                               initialization_timeout=int(options.init_timeout) + 30,
                               heartbeat_timeout_seconds=int(2 * options.peer_timeout) + 10,
                               shutdown_timeout_seconds=int(options.peer_timeout) + 10)
  finally:
    timer.cancel()
  state = _state()
  _watch = PeerWatch(state.client, state.process_id, state.num_processes, options.peer_timeout,
                     on_failure=abort)
  configure_logging()
  _watch.start()
  atexit.register(_watch.stop)  # runs before JAX's shutdown barrier (registered earlier)
  sys.excepthook = _failing_hook(sys.excepthook)
  return True


def _failing_hook(previous):
  """An uncaught exception in a program that joined the job: print it, then tell the peers."""
  def hook(kind, value, traceback):
    previous(kind, value, traceback)
    first = str(value).splitlines()[0] if str(value) else ""
    fail(f"{kind.__name__}: {first}", 1)
  return hook


def _state():
  from jax._src import distributed  # the runtime's client: its key-value store (as Orbax uses it)
  return distributed.global_state


def _process() -> tuple[int, int] | None:
  """(process id, number of processes): from the runtime once it runs (also when the program
  called jax.distributed.initialize itself), else what the options said."""
  if "jax._src.distributed" in sys.modules and _state().client is not None:
    return _state().process_id, _state().num_processes
  return _identity


def is_multiprocess() -> bool:
  return (_process() or (0, 1))[1] > 1


def is_primary() -> bool:
  """Process 0 (or the only process): the one that prints and writes shared files."""
  return (_process() or (0, 1))[0] == 0


def coordination():
  """(key-value store client, process id, number of processes, peer timeout in seconds) of a
  multi-process job; None for one process."""
  if not is_multiprocess():
    return None
  process_id, num_processes = _process()
  return (_state().client, process_id, num_processes,
          _watch.timeout if _watch else DistributedOptions.peer_timeout)


def label() -> str:
  """'[process 1] ' in a multi-process job, else ''."""
  return f"[process {_process()[0]}] " if is_multiprocess() else ""


def configure_logging(level=logging.WARNING):
  """Warnings and errors of every process reach its stderr, each line naming the process."""
  logging.basicConfig(level=level, format=f"{label()}%(levelname)s %(name)s: %(message)s", force=True)
  logging.captureWarnings(True)


def share_from_process_0(key: str, compute, timeout_s: float | None = None) -> str:
  """Process 0 computes a string; every process gets it through the runtime's key-value store
  (one process: just `compute()`). `key` must be new in this job."""
  if not is_multiprocess():
    return compute()
  client = _state().client
  key = f"jaxpar/shared/{key}"
  if _process()[0] == 0:
    value = compute()
    client.key_value_set(key, value)
    return value
  timeout_s = timeout_s or (_watch.timeout if _watch else DistributedOptions.peer_timeout) + 60
  return client.blocking_key_value_get(key, int(timeout_s * 1000))


def fail(message: str, code: int) -> None:
  """This process failed: tell the peers (they stop at once with `message` instead of waiting
  in a collective) and exit without JAX's shutdown barrier, which would wait for them."""
  if _watch is not None:
    _watch.stop(failed=message)
  _exit(code)


def abort(message: str, code: int = EXIT_PEER_FAILURE) -> None:
  """Report one line on stderr and end the process now (from any thread)."""
  sys.stderr.write(f"{label()}error: {message}\n")
  _exit(code)


def _exit(code: int):
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # noqa: BLE001  a closed pipe must not keep the process alive
      pass
  logging.shutdown()
  os._exit(code)
