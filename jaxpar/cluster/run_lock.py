"""One job per run directory: `<dir>/jaxpar.lock`, held for the whole of `Trainer.fit`.

Two jobs writing one run directory corrupt each other's checkpoints (each one's start-up
cleans the other's half-written save away). The lock is a kernel file lock (`flock`: local
disks and NFS), so it dies with its process however that ends; the file names the holder
(host, pid, start time) for the one-line refusal. A file left by a process that no longer
holds the lock is taken over with a note. In a multi-process job process 0 holds it and every
process learns the verdict, so all of them refuse together.
"""

import contextlib
import fcntl
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path

from jaxpar.cluster import distributed
from jaxpar.errors import UserError

LOCK_NAME = "jaxpar.lock"
_calls = itertools.count()  # one key-value key per fit() in this job (the same on every process)


def _describe(holder: dict) -> str:
  return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
          f"{holder.get('started', '?')}")


def _read(fd: int) -> dict:
  os.lseek(fd, 0, os.SEEK_SET)
  raw = os.read(fd, 1 << 16)
  try:
    return json.loads(raw) if raw.strip() else {}
  except ValueError:
    return {"host": "?", "pid": "?", "started": "? (unreadable lock file)"}


class RunLock:
  """`acquire()` returns a note when it took over a dead job's lock; refuses with ValueError."""

  def __init__(self, directory):
    self.directory = Path(directory)
    self.path = self.directory / LOCK_NAME
    self._fd: int | None = None

  def acquire(self) -> str | None:
    self.directory.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # the holder may remove the file between our open and our lock
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _read(fd)
        os.close(fd)
        raise UserError(f"run directory {self.directory} is in use by another job ({_describe(holder)}; "
                         f"lock {self.path}): wait for it to end, stop it, or set another train.run_dir") from None
      except OSError as e:
        os.close(fd)
        raise UserError(f"cannot lock {self.path} ({e.strerror}): put train.run_dir on a file system "
                         "with file locks (a local disk or NFS)") from None
      if self.path.exists() and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
        break
      os.close(fd)
    else:
      raise UserError(f"could not lock {self.path}: another job keeps replacing it")
    previous = _read(fd)
    mine = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
    self._fd = fd
    if previous:
      return f"took over the lock of a job that is gone ({_describe(previous)})"
    return None

  def release(self):
    if self._fd is None:
      return
    try:
      self.path.unlink(missing_ok=True)  # before unlocking: a waiting job then locks a fresh file
    finally:
      os.close(self._fd)
      self._fd = None


@contextlib.contextmanager
def hold_run_dirs(directories, say=print):
  """Lock each directory for the duration (process 0 of a multi-process job; the verdict is
  shared so every process raises the same one-line error). `say` gets takeover notes."""
  locks = [RunLock(d) for d in dict.fromkeys(Path(d).absolute() for d in directories)]
  held = []

  def take() -> str:
    try:
      for lock in locks:
        note = lock.acquire()
        held.append(lock)
        if note:
          say(note)
    except ValueError as e:
      for lock in held:
        lock.release()
      held.clear()
      return str(e)
    return ""

  refusal = distributed.share_from_process_0(f"run_lock/{next(_calls)}", take)
  if refusal:
    raise UserError(refusal)
  try:
    yield
  finally:
    for lock in held:
      lock.release()
