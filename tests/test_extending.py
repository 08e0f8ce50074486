"""docs/extending.md's two walk-throughs, followed as written:

- a family with a new activation, in a package of its own found through its entry point:
  the page's files are written as they stand (and the `.dist-info` that `pip install -e`
  would write beside them, since tests install nothing), its commands run, and the exported
  checkpoint loads in transformers with the trained model's logits;
- an attention option (ALiBi): the page's diff is applied to a copy of the tree, and its
  check (chunked == reference, forward and backward; the model trains) runs against the copy.
"""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import tomllib

import pytest

pytestmark = pytest.mark.optimized  # the walk-throughs train and export in processes of their own

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "extending.md"
BLOCK = re.compile(r"^```(\w+)([^\n]*)\n(.*?)^```", re.S | re.M)


def _blocks(**attrs) -> list[tuple[str, str]]:
  """(info string, body) of the page's fenced blocks whose info has every key=value given."""
  found = []
  for language, info, body in BLOCK.findall(PAGE.read_text()):
    given = dict(pair.split("=", 1) for pair in info.split())
    if all(given.get(key) == value or (value is True and key in given) for key, value in attrs.items()):
      found.append((f"{language}{info}", body))
  return found


def _env(*paths: pathlib.Path) -> dict:
  """This interpreter's environment with `paths` first on the import path."""
  python_path = [str(p) for p in paths] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  return {**os.environ, "PYTHONPATH": os.pathsep.join(python_path)}


def _run(command: list[str], cwd, env, timeout=600) -> str:
  done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
  assert done.returncode == 0, f"{shlex.join(command)}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
  return done.stdout


def _install_like_pip(project: pathlib.Path):
  """The .dist-info `pip install -e` writes: the name, version and entry points of pyproject.toml."""
  meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
  info = project / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
  info.mkdir()
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
  groups = meta.get("entry-points", {})
  (info / "entry_points.txt").write_text("".join(
      f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
      for group, entries in groups.items()))


CHECK_EXPORT = textwrap.dedent("""
    import json, sys
    import jax.numpy as jnp, numpy as np, torch, transformers
    import jaxpar
    tokens = np.array([[5, 17, 99, 3, 250, 42, 7, 64]])
    ours = np.asarray(jaxpar.open_run("runs/toy").model(jnp.asarray(tokens))[0])
    hf_config = json.load(open("hf-toy/config.json"))
    model = transformers.AutoModelForCausalLM.from_pretrained("hf-toy", torch_dtype=torch.float32)
    with torch.no_grad():
      theirs = model(torch.tensor(tokens)).logits.numpy()
      as_silu = transformers.LlamaForCausalLM.from_pretrained("hf-toy", hidden_act="silu")(torch.tensor(tokens))
    print(json.dumps({"architecture": type(model).__name__, "hidden_act": hf_config["hidden_act"],
                      "error": float(np.abs(ours - theirs).max()),
                      "silu_error": float(np.abs(ours - as_silu.logits.numpy()).max())}))
""")


def test_the_family_walk_trains_and_exports_a_llama_that_transformers_runs(tmp_path):
  files = _blocks(file=True)
  assert {info.split("file=")[1] for info, _ in files} == {"toy-family/pyproject.toml",
                                                          "toy-family/toy_family/__init__.py"}
  for info, body in files:
    path = tmp_path / info.split("file=")[1].split()[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
  [(_, commands)] = _blocks(walk="family")
  env = _env(tmp_path / "toy-family")
  for line in commands.splitlines():
    command = shlex.split(line)
    if command[:2] == ["pip", "install"]:
      _install_like_pip(tmp_path / command[-1])
    else:
      assert command[0] == "jaxpar", line
      _run([sys.executable, "-m", "jaxpar", *command[1:]], tmp_path, env)
  result = json.loads(_run([sys.executable, "-c", CHECK_EXPORT], tmp_path, env).splitlines()[-1])
  assert result["architecture"] == "LlamaForCausalLM" and result["hidden_act"] == "relu2"
  assert result["error"] < 1e-4, result
  assert result["silu_error"] > 1e-2, "the exported model runs the family's activation, not Llama's"


def _copy_of_the_tree(into: pathlib.Path) -> pathlib.Path:
  """The checkout's code as it is laid out (jaxpar/ with its links, and the folders they name)."""
  ignore = shutil.ignore_patterns("__pycache__", "*.so")
  for top in ("jaxpar", "models", "mesh", "pallas_kernels", "configs"):
    shutil.copytree(ROOT / top, into / top, symlinks=True, ignore=ignore)
  return into


def test_the_attention_option_walk_runs_on_a_copy_with_the_diff_applied(tmp_path):
  tree = _copy_of_the_tree(tmp_path / "tree")
  [(_, diff)] = [block for block in _blocks() if block[0] == "diff"]
  (tmp_path / "alibi.diff").write_text(diff)
  _run(["git", "apply", "--verbose", str(tmp_path / "alibi.diff")], tree, os.environ)
  assert "alibi" in (tree / "pallas_kernels/attention/spec.py").read_text()
  assert "alibi" not in (ROOT / "pallas_kernels/attention/spec.py").read_text(), "the walk starts from the tree"
  [(_, check)] = _blocks(walk="attention-option")
  out = _run([sys.executable, "-c", check], tmp_path, _env(tree))
  first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
  assert last < first - 0.5, out
