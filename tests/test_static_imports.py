"""A static reader follows `jaxpar.models.X` to `models/X.py` (and mesh/, pallas_kernels/).

models/, mesh/ and pallas_kernels/ live at the top of the checkout but import as
`jaxpar.models` etc. through the links `jaxpar/models -> ../models` (see the README's
layout). An IDE's go-to-definition reads files, it does not run import hooks; these tests
ask one (jedi) where three imports lead, from the checkout and from another folder that
uses the installed jaxpar, and compare the real paths with the top-level files.
"""

import os
import sys
from pathlib import Path

import jedi
import pytest

CHECKOUT = Path(__file__).resolve().parents[1]

# name imported -> the file it must lead to, relative to the checkout
PROBES = {
  "Attention": ("from jaxpar.models.attention import Attention", "models/attention.py"),
  "logical_shard_map": ("from jaxpar.mesh import logical_shard_map", "mesh/shard_map.py"),
  "ring_attention": ("from jaxpar.pallas_kernels.attention.ring import ring_attention",
                     "pallas_kernels/attention/ring.py"),
}


@pytest.fixture(scope="module")
def environment():
  """This interpreter as jedi sees it from outside (a subprocess), like an editor would."""
  return jedi.create_environment(sys.executable, safe=False)


@pytest.mark.parametrize("reader", ["in the checkout", "in another folder"])
def test_go_to_definition_lands_in_the_top_level_folders(reader, environment, tmp_path):
  project = CHECKOUT if reader == "in the checkout" else tmp_path
  code = "\n".join(line for line, _ in PROBES.values()) + "\n"
  script = jedi.Script(code, path=project / "probe.py", project=jedi.Project(project),
                       environment=environment)
  for row, (name, (line, expected)) in enumerate(PROBES.items(), start=1):
    found = script.goto(row, line.rindex(name), follow_imports=True)
    paths = [os.path.realpath(d.module_path) for d in found if d.module_path]
    assert paths == [str(CHECKOUT / expected)], (
        f"{line!r} read {reader}: jedi went to {paths or 'nothing'}, not {expected}; "
        "is jaxpar installed editable (pip install -e) from this checkout, with the jaxpar/<name> links?")
    assert found[0].name == name
