"""The README and docs/ point only at things that exist.

Checked in every page: relative links (file and #anchor), config names (`configs/NAME.yaml`,
`jaxpar train NAME` and the like in code, `load_config("NAME"`), repository paths written
as code (`models/moe.py`, `tests/test_moe*.py`), and `jaxpar.*` names written as code or in
Python examples (`jaxpar.open_run`, `from jaxpar.inference import Engine`).
"""

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHIPPED = {p.stem for p in (ROOT / "configs").glob("*.yaml")}

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)  # any info string after the language
_INLINE = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*)$", re.M)
_CONFIG_FILE = re.compile(r"configs/([\w.-]+)\.yaml")
# `jaxpar train NAME`, `.venv/bin/jaxpar compile NAME`, `[jaxpar, train, NAME`, `launch-local 2 -- train NAME`
_COMMAND = re.compile(r"\bjaxpar[ ,]+(?:launch-local +\d+ +-- +)?(?:train|compile|plan|config +show)[ ,]+(\w[\w.-]*)")
_LOAD = re.compile(r"load_config\(\s*[\"']([^\"']+)[\"']")
_REPO_PATH = re.compile(r"(?:jaxpar|models|mesh|pallas_kernels|tests|benchmarks|docs)/[\w./*-]*")
_DOTTED = re.compile(r"\bjaxpar(?:\.[A-Za-z_]\w*)+")


def _anchors(text: str) -> set[str]:
  """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -N for repeats."""
  seen, anchors = {}, set()
  for heading in _HEADING.findall(_FENCE.sub("", text)):
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
    seen[slug] = seen.get(slug, 0) + 1
  return anchors


def _code(text: str) -> tuple[list[str], list[str]]:
  """(every code block and inline code span, the Python blocks)."""
  blocks = _FENCE.findall(text)
  spans = _INLINE.findall(_FENCE.sub("", text))
  return [body for _, body in blocks] + spans, [body for lang, body in blocks if lang == "python"]


def _resolves(name: str) -> bool:
  """`jaxpar.a.b.c`: the longest importable module prefix, then attributes."""
  parts = name.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      target = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    try:
      for attribute in parts[cut:]:
        target = getattr(target, attribute)
    except AttributeError:
      return False
    return True
  return False


def problems(page: Path, text: str) -> list[str]:
  """Every reference in `text` (the page at `page`) to something that does not exist."""
  found = []
  for target in _LINK.findall(_FENCE.sub("", text)):
    if re.match(r"[a-z]+:", target):
      continue  # http(s), mailto: not checked here
    file, _, anchor = target.partition("#")
    path = (page.parent / file).resolve()
    if file and (not path.exists() or not path.is_relative_to(ROOT)):
      found.append(f"link {target}: {file} does not exist")
    elif anchor and (not file or path.suffix == ".md"):
      if anchor not in _anchors(path.read_text() if file else text):
        found.append(f"link {target}: {path.name if file else page.name} has no heading #{anchor}")
  code, python = _code(text)
  for name in _CONFIG_FILE.findall(text):
    if name not in SHIPPED:
      found.append(f"configs/{name}.yaml is not a shipped config")
  for snippet in code:
    for name in _COMMAND.findall(snippet) + _LOAD.findall(snippet):
      if not (name.endswith(".yaml") or name.isupper() or "/" in name) and name not in SHIPPED:
        found.append(f"config {name!r} is not a shipped config")
  for span in _INLINE.findall(_FENCE.sub("", text)):
    if _REPO_PATH.fullmatch(span) and not list(ROOT.glob(span.rstrip("/"))):
      found.append(f"path {span} does not exist")
  names = set()
  for span in _INLINE.findall(_FENCE.sub("", text)):
    if (match := _DOTTED.match(span)):
      names.add(match.group())
  for block in python:
    names.update(_DOTTED.findall(block))
    for node in ast.walk(ast.parse(block)):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxpar"):
        names.update(f"{node.module}.{alias.name}" for alias in node.names)
  found += [f"{name} does not exist" for name in sorted(names) if not _resolves(name)]
  return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_exists(page):
  found = problems(page, page.read_text())
  assert not found, "\n".join(found)


def test_the_readme_stays_a_front_door():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 250
  linked = {Path(t.partition("#")[0]).name for t in _LINK.findall(readme) if t.startswith("docs/")}
  assert linked >= {p.name for p in PAGES[1:]}, "every docs/ page is reachable from the README"


def test_each_kind_of_broken_reference_is_found():
  page = ROOT / "docs" / "probe.md"
  text = "\n".join([
      "# Probe", "[a](missing.md) [b](training.md#no-such-heading) [c](training.md#a-config)",
      "[d](#probe) [e](https://example.com/x.md)",
      "`configs/nope.yaml` and `jaxpar train nope mesh.fsdp=2` and `jaxpar train my.yaml`",
      "`models/nope.py` `models/attention.py` `tests/test_moe*.py`",
      "`jaxpar.open_run` `jaxpar.open_runs` `jaxpar.models.register_family(ModelFamily(...))`",
      "```python", "from jaxpar.inference import Engine, NoEngine", 'jaxpar.load_config("nope2")', "```",
  ])
  assert problems(page, text) == [
      "link missing.md: missing.md does not exist",
      "link training.md#no-such-heading: training.md has no heading #no-such-heading",
      "configs/nope.yaml is not a shipped config",
      "config 'nope2' is not a shipped config",
      "config 'nope' is not a shipped config",
      "path models/nope.py does not exist",
      "jaxpar.inference.NoEngine does not exist",
      "jaxpar.open_runs does not exist",
  ]


def _section(text: str, heading: str) -> str:
  start = text.index(heading)
  end = text.find("\n## ", start + len(heading))
  return text[start:end if end > 0 else None]


def test_the_tables_list_what_ships():
  """The shipped-configs table (docs/training.md) names every shipped config, and the
  README's command table every `jaxpar` command."""
  configs = _section((ROOT / "docs" / "training.md").read_text(), "## Shipped configs")
  listed = set(re.findall(r"\(\.\./configs/([\w.-]+)\.yaml\)", configs))
  assert listed == SHIPPED, (sorted(SHIPPED - listed), sorted(listed - SHIPPED))
  from jaxpar.cli import build_parser
  commands = next(a for a in build_parser()._actions if a.dest == "command").choices
  table = _section((ROOT / "README.md").read_text(), "## The command line")
  rows = "\n".join(line for line in table.splitlines() if line.startswith("|"))
  named = set(re.findall(r"`jaxpar ([\w-]+)", rows))
  assert named == set(commands), (sorted(set(commands) - named), sorted(named - set(commands)))


def _documented_commands():
  """(page, command) for every `jaxpar ...` line of the pages' shell blocks."""
  for page in PAGES:
    for language, body in _FENCE.findall(page.read_text()):
      if language not in ("", "bash", "sh", "shell"):
        continue
      for line in body.splitlines():
        line = line.split("  #")[0].strip().split("&&")[-1].strip().rstrip("\\").strip()
        if re.match(r"^(\w+=\S+ )*jaxpar \w", line):
          yield page.relative_to(ROOT), line


def test_every_documented_command_parses_and_names_config_keys_that_exist(capsys):
  """The docs' commands in a shortened form (tests/test_walkthrough.py runs the README's): each
  one's options parse as the CLI parses them, and its config and overrides load (data paths
  need not exist here)."""
  import shlex

  import yaml

  from jaxpar import cli
  from jaxpar.config import from_dict, parse_overrides, resolve_config_path, _set_dotted
  checked, failures = 0, []
  for page, command in _documented_commands():
    if "model.family=toy" in command:  # docs/extending.md registers the family `toy` first
      continue
    words = shlex.split(command.replace("...", ""))
    args = words[[w.split("=")[0] for w in words].index("jaxpar") + 1:]
    try:
      ns = cli._parse(cli.build_parser(), args)
      ns = cli._parse(cli.build_parser(), ns.launched) if hasattr(ns, "launched") else ns
      config_args = getattr(ns, "args", None)
      name = config_args[0] if config_args and "=" not in config_args[0] else None
      if config_args is not None and (name is None or name in SHIPPED):
        tree = yaml.safe_load(resolve_config_path(name).read_text())
        for key, value in parse_overrides(config_args[1 if name else 0:]):
          _set_dotted(tree, key, value)
        from_dict(tree, check_paths=False)
      checked += 1
    except (SystemExit, Exception) as e:  # noqa: BLE001 (argparse exits; config errors raise)
      failures.append(f"{page}: {command}\n  {type(e).__name__}: {e} {capsys.readouterr().err.strip()[-300:]}")
  assert not failures, "\n".join(failures)
  assert checked >= 60, checked
