"""Resumes a data mixture in a multi-process job and writes the global batches it reads (run
by tests/test_data_mixture.py through `jaxpar launch-local`):

    python tests/multiprocess_data_worker.py DATA_CONFIG_JSON STATE_JSON OUT_NPZ

Each process loads only the rows its devices hold of an FSDP-sharded batch on one mesh over
every process's devices; process 0 writes the gathered batches and the final state.
"""

import json
import sys

from jaxpar.cluster import distributed

distributed.initialize()  # from the JAX_* variables launch-local sets

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jaxpar.config import DataConfig  # noqa: E402
from jaxpar.data import TrainBatches, load_tokenizer  # noqa: E402


def main():
  config, state, out = DataConfig(**json.loads(sys.argv[1])), json.loads(sys.argv[2]), sys.argv[3]
  assert jax.process_count() == 2, "run me through jaxpar launch-local 2"
  mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  batches = TrainBatches(config, load_tokenizer("byte"), NamedSharding(mesh, PartitionSpec("fsdp", None)))
  batches.set_state(state)
  seen = {}
  for step in range(2):
    batch = next(batches)
    for key, value in multihost_utils.process_allgather(batch, tiled=True).items():
      seen[f"{step}.{key}"] = np.asarray(value)
  if jax.process_index() == 0:
    np.savez(out, state=json.dumps(batches.get_state()), **seen)


if __name__ == "__main__":
  main()
