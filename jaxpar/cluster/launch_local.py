"""`jaxpar launch-local N -- COMMAND`: one multi-process job on this machine.

For trying multi-host behaviour without a cluster. Each process gets its own simulated CPU
devices, gloo for the collectives between processes, and the `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` variables that `jaxpar.cluster.distributed.initialize` reads;
the coordinator listens on 127.0.0.1 only. The processes run in their own session, so a
Ctrl-C reaches them through the launcher: the first Ctrl-C or SIGTERM is passed on as
SIGTERM (a preemption notice: every process stops after the same step and saves); signals
within SAME_SIGNAL_S of it are that one again (`timeout` sends two at once); a later one
kills them. When a process fails, the others get `grace_s` to stop by themselves (they
notice within --peer-timeout) before they are killed, so the launcher never hangs.

The processes' standard output passes through the launcher as it comes, less gloo's
`[Gloo] Rank N is connected to M peer ranks` line for every connection it makes (16 for two
processes of four devices), even when two of them interleave into one line or one lands after
a partial line of the program's own (streamed tokens): nothing a user can act on. Standard
error is theirs untouched.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from jaxpar.cluster.preemption import SAME_SIGNAL_S
from jaxpar.errors import UserError

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")
# Anywhere in a line: gloo's threads write their banners at once, and two can interleave
# piece by piece ("[Gloo] Rank [Gloo] Rank 1 is connected to 11 is ..."), leaving a line that
# starts mid-banner ("Expected number of connected peer ranks is : 7"). Gloo ends each banner
# with a newline, so from its first piece to the line's end is gloo's; before it, the program's.
_GLOO_BANNER = re.compile(rb"\[Gloo\] Rank|is connected to|peer ranks|Expected number of")


def _without_banner(line: bytes) -> bytes:
  """A complete line, less any gloo banner text (and then less its newline: the line was the
  program's partial line that the banner's newline ended)."""
  found = _GLOO_BANNER.search(line)
  return line + b"\n" if found is None else line[:found.start()]


def free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def process_env(process_id: int, num_processes: int, port: int, devices: int, base=None) -> dict:
  env = dict(os.environ if base is None else base)
  flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
  env.update({
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
      "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
      "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
      "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",  # JAX's default binds every interface
      "JAX_NUM_PROCESSES": str(num_processes),
      "JAX_PROCESS_ID": str(process_id),
      "PYTHONUNBUFFERED": "1",  # lines from the processes interleave as they come
  })
  if sys.stdout.isatty():  # their output reaches a terminal through us: progress bars stay live
    columns, lines = shutil.get_terminal_size()
    env.update({"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": str(columns), "LINES": str(lines)})
  return env


def _forward(stream, out):
  """Copy a process's output to `out` as it comes, dropping gloo's connection banners. A
  partial line goes out at once (a live progress bar redraws without newlines, generation
  streams tokens) up to anything that is or may start a banner."""
  pending = b""
  while chunk := stream.read1(65536):
    *lines, pending = (pending + chunk).split(b"\n")
    kept = b"".join(_without_banner(line) for line in lines)
    banner = _GLOO_BANNER.search(pending)
    if banner:  # the program's text before it goes now; the banner waits for its newline
      kept, pending = kept + pending[:banner.start()], pending[banner.start():]
    elif pending and not b"[Gloo]".startswith(pending[:6]):
      kept, pending = kept + pending, b""
    out.write(kept)
    out.flush()
  if pending:
    found = _GLOO_BANNER.search(pending)
    out.write(pending if found is None else pending[:found.start()])
    out.flush()


def _describe(code: int) -> str:
  if code < 0:
    return f"was killed by {signal.Signals(-code).name}"
  return f"exited with code {code}"


def launch_local(num_processes: int, argv: list[str], *, devices_per_process: int = 4,
                 port: int | None = None, grace_s: float = 90.0, echo=print) -> int:
  """Run `argv` as processes 0..N-1 of one job and wait for all of them. Returns 0 when all
  succeed, else the exit code of the first to fail (128 + signal number when killed)."""
  if num_processes < 1 or devices_per_process < 1:
    raise UserError(f"launch-local needs N >= 1 and --devices-per-process >= 1; got "
                     f"{num_processes} and {devices_per_process}")
  if not argv:
    raise UserError("launch-local: give the command after --, e.g. jaxpar launch-local 2 -- train tiny")
  port = port or free_port()
  processes = [subprocess.Popen(argv, env=process_env(i, num_processes, port, devices_per_process),
                                stdout=subprocess.PIPE, start_new_session=True) for i in range(num_processes)]
  out = sys.stdout.buffer
  out.flush()
  forwarders = [threading.Thread(target=_forward, args=(p.stdout, out), daemon=True) for p in processes]
  for thread in forwarders:
    thread.start()
  echo(f"launch-local: {num_processes} processes x {devices_per_process} CPU devices, coordinator "
       f"127.0.0.1:{port}, pids {' '.join(str(p.pid) for p in processes)}")
  received = []
  previous = {s: signal.signal(s, lambda signum, _: received.append((signum, time.monotonic())))
              for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    return _wait(processes, received, grace_s, echo)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for thread in forwarders:
      thread.join(timeout=10)


def _wait(processes, received, grace_s, echo) -> int:
  seen, stop_at, killed, first_failure, failed_at = 0, None, False, None, None
  while any(p.poll() is None for p in processes):
    for signum, at in received[seen:]:
      name = signal.Signals(signum).name
      if stop_at is None:
        stop_at = at
        echo(f"launch-local: {name}: sending SIGTERM to the processes (they stop after the same step and save)")
        _send(processes, signal.SIGTERM)
      elif at - stop_at > SAME_SIGNAL_S and not killed:
        killed = True
        echo(f"launch-local: {name} again: sending SIGKILL to the processes")
        _send(processes, signal.SIGKILL)
    seen = len(received)
    if first_failure is None:  # the others' grace period counts from the first failure seen
      first_failure = next((i for i, p in enumerate(processes) if p.poll() not in (None, 0)), None)
      failed_at = time.monotonic()
    elif time.monotonic() - failed_at > grace_s:
      echo(f"launch-local: killing the processes still running {grace_s:g} s after process "
           f"{first_failure} failed")
      _send(processes, signal.SIGKILL)
    time.sleep(0.1)
  failures = [(i, p.returncode) for i, p in enumerate(processes) if p.returncode]
  for i, code in failures:
    echo(f"launch-local: process {i} {_describe(code)}")
  if not failures:
    return 0
  code = processes[first_failure if first_failure is not None else failures[0][0]].returncode
  return 128 - code if code < 0 else code


def _send(processes, signum):
  for p in processes:
    if p.poll() is None:
      p.send_signal(signum)
