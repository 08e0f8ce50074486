"""Checkpoint cost on 8 simulated CPU devices: how long an async save blocks the train loop,
how long it takes in all, restore time (same mesh and another mesh), bytes on disk.

  python benchmarks/checkpoint.py [CONFIG ...]     (default: tiny bench-50m)
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from jaxpar.checkpoint import Checkpointer  # noqa: E402
from jaxpar.config import load_config  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402

SAVES = 3  # timed saves, after one warm-up
# The batch only has to divide over the mesh; no step runs.
MESHES = {"fsdp8": ["mesh.fsdp=8", "mesh.tensor=1", "data.global_batch_size=8"],
          "tp2 x fsdp4": ["mesh.fsdp=4", "mesh.tensor=2", "data.global_batch_size=8"]}


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return out, time.perf_counter() - start


def measure(name: str, directory: Path) -> dict:
  source = Trainer(load_config(name, MESHES["fsdp8"]))
  # One step, so the Adam moments are not all zeros (zeros compress to nothing on disk).
  state, _ = source.step(source.init_state(), next(source.batches()))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
  blocked, total = [], []
  with Checkpointer(directory) as checkpoints:
    for step in range(SAVES + 1):
      start = time.perf_counter()
      checkpoints.save(step, state, data_state={"next_sample": step}, config=source.config, force=True)
      returned = time.perf_counter() - start
      checkpoints.wait()
      if step:  # step 0 warms up orbax and tensorstore
        blocked.append(returned)
        total.append(time.perf_counter() - start)
  disk = sum(f.stat().st_size for f in (directory / str(SAVES)).rglob("*") if f.is_file())
  row = {"config": name, "params": source.num_params, "state_mb": state_bytes / 2**20,
         "blocked_s": statistics.median(blocked), "total_s": statistics.median(total),
         "disk_mb": disk / 2**20}
  for mesh, overrides in MESHES.items():
    target = Trainer(load_config(name, overrides)).abstract_state()
    with Checkpointer(directory, read_only=True) as checkpoints:
      _, row[f"restore {mesh}"] = _timed(lambda: checkpoints.restore(target)[0])
  return row


def main(names):
  table = Table(title=f"Checkpoints on {jax.device_count()} simulated {jax.default_backend()} devices "
                f"(async save; median of {SAVES})")
  for column in ("config", "params", "state MB", "save blocks loop s", "save total s",
                 *(f"restore onto {m} s" for m in MESHES), "on disk MB"):
    table.add_column(column, justify="left" if column == "config" else "right")
  for name in names:
    directory = Path(tempfile.mkdtemp(prefix="jaxpar-ckpt-bench-"))
    try:
      r = measure(name, directory / "checkpoints")
    finally:
      shutil.rmtree(directory)
    table.add_row(r["config"], f"{r['params']:,}", f"{r['state_mb']:.1f}", f"{r['blocked_s']:.3f}",
                  f"{r['total_s']:.3f}", *(f"{r[f'restore {m}']:.3f}" for m in MESHES),
                  f"{r['disk_mb']:.1f}")
  Console(width=160).print(table)


if __name__ == "__main__":
  main(sys.argv[1:] or ["tiny", "bench-50m"])
