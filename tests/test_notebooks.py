"""The example notebooks cannot rot: each is executed here, top to bottom, on CPU, in a
fresh kernel in its own directory, with small parameters injected after its `parameters`
cell (as papermill does), on one CPU device, as on a Colab CPU runtime; a last cell then
asserts what the notebook shows (a loss that falls, a sample, the same text in transformers,
a fit verdict and a plan)."""

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

EXAMPLES = Path(__file__).parent.parent / "examples"
SMALL = ["model.num_layers=1", "model.scan_unroll=1"]
PARAMETERS = {
  "quickstart": {"STEPS": 8, "BATCH": 8, "SAMPLE_TOKENS": 8, "EXTRA": [*SMALL, "train.warmup_steps=2"]},
  "finetune_hf": {"STEPS": 3, "MAX_NEW_TOKENS": 8, "EXTRA": ["data.global_batch_size=4", "data.seq_len=64"]},
  "rl_grpo": {"SFT_STEPS": 3, "GRPO_STEPS": 2, "EVAL_EVERY": 2, "EXTRA": [*SMALL, "data.global_batch_size=8"],
              "RL_EXTRA": ["objective.max_tokens=8"]},
  # A tiny model for a small slice: compiles in seconds (the real config takes minutes).
  "tpu_pod_plan": {"CONFIG": "tiny", "TOPOLOGY": "v5e-4", "PLAN_TOP": 1,
                   "OVERRIDES": [*SMALL, "data.global_batch_size=8", "data.seq_len=64"]},
}


# What each notebook shows, asserted in its own kernel after its last cell.
CHECKS = {
  "quickstart": """
assert summary["steps"] == STEPS and summary["final_loss"] < summary["first_loss"], summary
assert 0 < len(completion.tokens) <= SAMPLE_TOKENS and completion.text, completion
assert last["step"] == STEPS and pathlib.Path("quickstart.png").stat().st_size > 0
""",
  "finetune_hf": """
losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
assert len(losses) == STEPS and losses[-1] < losses[0], losses
assert theirs == after[0]  # the merged export generates what jaxpar generates
""",
  "rl_grpo": """
assert 0 <= before["heldout_pass@1"] <= 1 and 0 <= after["heldout_pass@1"] <= 1, (before, after)
assert sft_summary["final_loss"] < sft_summary["first_loss"], sft_summary
rewards = [r["reward"] for r in map(json.loads, (pathlib.Path(RL_DIR) / "metrics.jsonl").read_text().splitlines())
           if "reward" in r]
assert len(rewards) == GRPO_STEPS and pathlib.Path("grpo.png").stat().st_size > 0
assert isinstance(answer.text, str) and 0 < len(answer.tokens) <= 32
""",
  "tpu_pod_plan": """
assert report["fits"] and report["devices"] == 4 and 0 < report["estimate"]["mfu"] < 1, report["oom"]
assert fitting and pathlib.Path("plan.yaml").read_text() == to_yaml(winner)
""",
}


def test_every_notebook_has_parameters():
  assert sorted(p.stem for p in EXAMPLES.glob("*.ipynb")) == sorted(PARAMETERS) == sorted(CHECKS)


def _with_parameters(notebook, values: dict):
  """Insert a cell setting `values` after the cell tagged `parameters`."""
  index = next(i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", []))
  defined = notebook.cells[index].source
  assert all(f"{name} =" in defined for name in values), f"not parameters of this notebook: {values}"
  source = "\n".join(f"{name} = {value!r}" for name, value in values.items())
  notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(source))
  return notebook


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_notebook_runs_top_to_bottom(name, tmp_path):
  if name == "tpu_pod_plan":
    pytest.importorskip("libtpu")
  notebook = _with_parameters(nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4), PARAMETERS[name])
  notebook.cells.append(nbformat.v4.new_code_cell("import json, pathlib\n" + CHECKS[name]))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as on Colab
  env["JAX_PLATFORMS"] = "cpu"
  client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute(env=env)  # raises CellExecutionError, with the cell and its traceback
  outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  errors = [o for o in outputs if o.get("output_type") == "error"]
  assert not errors, errors
