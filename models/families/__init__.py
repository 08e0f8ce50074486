"""Model families, one folder each: its config defaults, any blocks of its own, its Hugging
Face mapping both ways and its FLOPs, registered when the folder's package is imported.
Shared layers stay one level up (models/). `load()` imports every folder here and every
installed `jaxpar.families` entry point (jaxpar/plugins.py): a new family is a new folder,
or a package of its own, and no edit elsewhere."""

from jaxpar import plugins

ENTRY_POINTS = "jaxpar.families"


def load():
  plugins.load(__name__, __path__, ENTRY_POINTS)
