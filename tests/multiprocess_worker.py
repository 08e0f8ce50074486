"""One of two processes training together (run by tests/test_multiprocess.py).

    python tests/multiprocess_worker.py PROCESS_ID PORT OUT_JSON CONFIG_JSON
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_default_matmul_precision", "highest")


def main():
  process_id, port, out, config_json = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=process_id)
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from jaxpar.config import from_dict
  from jaxpar.trainer import Trainer
  trainer = Trainer(from_dict(json.loads(config_json)))
  result = trainer.fit(show_progress=False)
  with open(out, "w") as f:
    json.dump({"devices": jax.device_count(), "local_devices": jax.local_device_count(),
               "losses": [h["loss"] for h in result.history]}, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
