"""C++ kernels for XLA's CPU backend (XLA FFI custom calls), compiled on first use.

A kernel is one C++ source next to its Python door. The first process that needs it
compiles it with the system's C++ compiler (`$CXX`, else `c++`) against the XLA FFI
headers that jaxlib ships, for this machine's CPU, into a cache directory
(`$JAXPAR_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxpar`, else `~/.cache/jaxpar`); later
processes load the cached library (a few seconds once, then nothing). The file name hashes
the source, the flags, jaxlib's version and the CPU's features, so an edit, an upgrade or
another machine sharing the directory gets its own build.

Where no compiler works, `load` warns once, naming what failed and the fix, and returns
None: the door then takes XLA's own path, which computes the same function (slower).
`JAXPAR_CPU_KERNELS=0` chooses that path without trying.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def enabled() -> bool:
  """Whether compiled CPU kernels may be used (`JAXPAR_CPU_KERNELS=0` turns them off); read
  at trace time, so a process can compare both paths."""
  return os.environ.get("JAXPAR_CPU_KERNELS", "1") != "0"


def cache_dir() -> Path:
  if os.environ.get("JAXPAR_CACHE_DIR"):
    return Path(os.environ["JAXPAR_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(base) / "jaxpar"


def _cpu_features() -> str:
  """What `-march=native` compiles for: the CPU's flags where Linux lists them."""
  try:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")
  except OSError:
    return platform.processor()


def _compile(source: Path, target: Path, compiler: str):
  target.parent.mkdir(parents=True, exist_ok=True)
  # Built beside its final name and renamed into place: processes building at once (test
  # workers) never load a half-written library.
  with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
    built = Path(scratch) / target.name
    subprocess.run([compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(built)],
                   check=True, capture_output=True, text=True)
    os.replace(built, target)


@functools.cache
def load(source: Path, symbols: tuple[str, ...]) -> bool:
  """Compile (or find cached) `source` and register each FFI handler in `symbols` as a CPU
  target of the same name. False, after one warning, when that cannot be done."""
  compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if compiler is None:
    log.warning("jaxpar: no C++ compiler found, so CPU decode attention runs as XLA ops (slower, same "
                "results); install one (e.g. g++) or set CXX, or set JAXPAR_CPU_KERNELS=0 to silence this")
    return False
  key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                                   jaxlib.__version__.encode(), _cpu_features().encode()])).hexdigest()[:16]
  target = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
  try:
    if not target.exists():
      _compile(source, target, compiler)
    library = ctypes.cdll.LoadLibrary(str(target))
  except (OSError, subprocess.CalledProcessError) as error:
    detail = getattr(error, "stderr", "") or str(error)
    first = next((line for line in detail.splitlines() if "error" in line.lower()), detail.strip()[:200])
    log.warning("jaxpar: building %s with %s failed (%s), so CPU decode attention runs as XLA ops (slower, "
                "same results); set CXX to a working C++17 compiler, or JAXPAR_CPU_KERNELS=0 to silence this",
                source.name, compiler, first)
    return False
  for symbol in symbols:
    jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
  return True
