"""jaxpar: train and serve large language models on device meshes with JAX/XLA.

    import jaxpar
    config = jaxpar.load_config("tiny", ["train.steps=100"])
    result = jaxpar.Trainer(config).fit()
    run = jaxpar.open_run(config.train.run_dir)     # the saved run: config, model, tokenizer

Names are imported on first use, so `import jaxpar` (and the CLI's --help) stays fast. On a
host with no TPU or GPU, JAX uses the CPU directly (see jaxpar/host.py): a script or notebook
is as quiet as the CLI even with the `tpu` extra's libtpu installed.
"""

import importlib

from jaxpar.host import use_cpu_without_accelerators

use_cpu_without_accelerators()  # before anything here imports jax

_EXPORTS = {
  "Config": "jaxpar.config", "load_config": "jaxpar.config",
  "UserError": "jaxpar.errors", "ConfigError": "jaxpar.errors", "CheckpointError": "jaxpar.errors",
  "DataError": "jaxpar.errors", "ParallelPlan": "jaxpar.parallel",
  "SavedRun": "jaxpar.weights", "open_run": "jaxpar.weights",
  "Runtime": "jaxpar.runtime", "TrainState": "jaxpar.train.state",
  "Trainer": "jaxpar.train.trainer", "TrainResult": "jaxpar.train.trainer", "train": "jaxpar.train.trainer",
  "plot_runs": "jaxpar.plot",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")
  return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
  return sorted(list(globals()) + __all__)
