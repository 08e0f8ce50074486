"""Plug-in discovery shared by the registries that take them (model families, training
objectives): every module or folder inside the registry's package (a package scan, so a
new one is a new file or folder and no edit elsewhere), then every installed distribution's
entry point in the registry's group, so a plug-in can also ship as its own package:

    [project.entry-points."jaxpar.families"]
    my_family = "my_package.my_family"
"""

import importlib
import pkgutil
from importlib.metadata import entry_points

from jaxpar.errors import ConfigError


def load(package: str, path, group: str):
  """Import (and so register) every module of `package` (at `path`, its __path__) and every
  entry point of `group`."""
  for module in pkgutil.iter_modules(path):
    importlib.import_module(f"{package}.{module.name}")
  for entry in entry_points(group=group):
    try:
      entry.load()
    except ImportError as error:
      raise ConfigError(f"the {group} entry point {entry.name} = {entry.value} does not import ({error}): "
                        "reinstall its package or uninstall it") from error
