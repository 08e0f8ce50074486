"""jaxpar's own import graph, read with `ast` from the checkout's real folders (not through the
jaxpar/models, jaxpar/mesh and jaxpar/pallas_kernels links): no cycle, imports inside
functions included (they hide a cycle, they do not remove it); no upward import between
layers; and no jaxpar import inside a function outside the command-line modules (which
import lazily so `jaxpar --help` stays fast)."""

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINKS = ("models", "mesh", "pallas_kernels")  # jaxpar/<name> links to the top-level folder
LEAVES = {"jaxpar.errors", "jaxpar.plugins"}  # import nothing of jaxpar's but each other
# Each layer and the jaxpar packages it may import (besides its own modules and LEAVES).
LAYERS = {
    "jaxpar.mesh": set(),
    "jaxpar.pallas_kernels": {"jaxpar.mesh"},
    "jaxpar.models": {"jaxpar.mesh", "jaxpar.pallas_kernels"},
}
# Saved weights sit below everything that trains, fine-tunes, serves or converts.
NOT_BELOW_WEIGHTS = ("jaxpar.train", "jaxpar.finetune", "jaxpar.inference", "jaxpar.convert", "jaxpar.objectives")


def _is_cli(module: str) -> bool:
  return module == "jaxpar.cli" or module.rsplit(".", 1)[-1] in ("commands", "eval_command")


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for top in ("jaxpar", *LINKS):
    for path in sorted((ROOT / top).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      if top == "jaxpar" and parts[1] in LINKS:
        continue  # through a link: read once, from the real folder
      name = ["jaxpar", *parts] if top in LINKS else parts
      found[".".join(name[:-1] if name[-1] == "__init__" else name)] = path
  return found


def _imports(module: str, path: pathlib.Path, modules) -> list[tuple[str, bool]]:
  """(imported jaxpar module, inside a function) for every import in the file; `from P import
  x` is module P.x where that exists, else P (the package's __init__ runs)."""
  package = module if path.name == "__init__.py" else module.rpartition(".")[0]
  tree = ast.parse(path.read_text(), str(path))
  in_function = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for node in ast.walk(fn)}
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
      names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    else:
      continue
    for name in names:
      while name and name not in modules:
        name = name.rpartition(".")[0]
      if name.startswith("jaxpar") and name != module:
        found.append((name, id(node) in in_function))
  return found


@pytest.fixture(scope="module")
def graph():
  modules = _modules()
  return {module: _imports(module, path, modules) for module, path in modules.items()}


def test_the_modules_are_found_through_the_real_folders(graph):
  assert {"jaxpar.models.families.llama", "jaxpar.pallas_kernels.attention.spec", "jaxpar.mesh.rules",
          "jaxpar.weights.saved", "jaxpar.cli"} <= set(graph)
  assert not any(".jaxpar." in module for module in graph)


def test_no_import_cycle(graph):
  sorter = graphlib.TopologicalSorter({module: {target for target, _ in edges} for module, edges in graph.items()})
  try:
    sorter.prepare()
  except graphlib.CycleError as error:
    pytest.fail(f"import cycle: {' -> '.join(error.args[1])}")


def test_no_upward_import(graph):
  upward = []
  for module, edges in graph.items():
    layer = next((name for name in LAYERS if module == name or module.startswith(name + ".")), None)
    for target, _ in edges:
      if target in LEAVES or (layer and (target == layer or target.startswith(layer + "."))):
        continue
      if module in LEAVES:
        upward.append(f"{module} -> {target}")
      elif layer and not any(target == ok or target.startswith(ok + ".") for ok in LAYERS[layer]):
        upward.append(f"{module} -> {target}")
      elif module.startswith("jaxpar.weights") and target.startswith(NOT_BELOW_WEIGHTS):
        upward.append(f"{module} -> {target}")
  assert not upward, upward


def test_jaxpar_imports_inside_functions_only_in_the_command_line(graph):
  hidden = [f"{module} -> {target}" for module, edges in graph.items() for target, inside in edges
            if inside and not _is_cli(module)]
  assert not hidden, hidden


def test_a_planted_cycle_and_upward_import_are_found(graph):
  """The checks bite: an import of the trainer inside a kernel is both."""
  planted = dict(graph)
  planted["jaxpar.pallas_kernels.attention.spec"] = [*graph["jaxpar.pallas_kernels.attention.spec"],
                                                     ("jaxpar.train.trainer", True)]
  with pytest.raises(pytest.fail.Exception, match="import cycle"):
    test_no_import_cycle(planted)
  with pytest.raises(AssertionError, match="spec -> jaxpar.train.trainer"):
    test_no_upward_import(planted)
  with pytest.raises(AssertionError, match="spec -> jaxpar.train.trainer"):
    test_jaxpar_imports_inside_functions_only_in_the_command_line(planted)
