"""Restores checkpoints in a multi-process job and writes the values it sees (run by
tests/test_multiprocess.py through `jaxpar launch-local`):

    python tests/multiprocess_worker.py CONFIG_JSON OUT_NPZ CHECKPOINT_DIR ...

Each checkpoint's train state is read onto CONFIG's mesh, every device reading its own
shards; process 0 then writes the gathered values and data positions.
"""

import json
import sys

from jaxpar.cluster import distributed

distributed.initialize()  # from the JAX_* variables launch-local sets

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxpar.checkpoint import Checkpointer  # noqa: E402
from jaxpar.config import from_dict  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402


def main():
  config, out, directories = from_dict(json.loads(sys.argv[1])), sys.argv[2], sys.argv[3:]
  trainer = Trainer(config)
  assert jax.process_count() > 1, "run me through jaxpar launch-local"
  abstract = trainer.abstract_state().items()
  values = {}
  for i, directory in enumerate(directories):
    with Checkpointer(directory, read_only=True) as checkpoints:
      state, data_state = checkpoints.restore(abstract)
    gathered = multihost_utils.process_allgather(state, tiled=True)
    for path, leaf in jax.tree_util.tree_leaves_with_path(gathered):
      values[f"{i}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
    values[f"{i}.next_sample"] = np.asarray(data_state["next_sample"])
  if jax.process_index() == 0:
    np.savez(out, **values)


if __name__ == "__main__":
  main()
