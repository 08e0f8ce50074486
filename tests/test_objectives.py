"""Objectives are plug-ins: the docs' walk-through objective registers, validates its own keys,
and trains through the unchanged trainer; unknown names and keys are one-line errors."""

import re
from pathlib import Path

import jax
import pytest

from tests.helpers import small_config
from jaxpar.config import from_dict
from jaxpar.errors import ConfigError
from jaxpar.objectives import OBJECTIVES
from jaxpar.train.trainer import Trainer

DOC = Path(__file__).parent.parent / "docs" / "extending.md"


def _walkthrough_code() -> str:
  section = DOC.read_text().split("## A training objective", 1)[1].split("\n## ", 1)[0]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def smoothed():
  """The objective docs/extending.md defines, registered by executing the page's code."""
  exec(compile(_walkthrough_code(), str(DOC), "exec"), {})
  yield OBJECTIVES["smoothed"]
  del OBJECTIVES["smoothed"]


def test_the_documented_objective_trains_and_validates_its_keys(smoothed):
  config = small_config(train={"objective": "smoothed", "steps": 4}, objective={"smoothing": 0.2})
  assert config.objective.smoothing == 0.2 and type(config.objective) is smoothed.Options
  trainer = Trainer(config, devices=jax.devices()[:1])
  history = trainer.fit(show_progress=False).history
  losses = [h["loss"] for h in history]
  assert len(losses) == 4 and losses[-1] < losses[0]
  with pytest.raises(ConfigError, match=r"objective.smoothing=1.5: Input should be less than 1"):
    small_config(train={"objective": "smoothed"}, objective={"smoothing": 1.5})


def test_unknown_objectives_and_keys_are_one_line_errors():
  with pytest.raises(ConfigError, match=r"train.objective='ppo' is not a registered objective; choose one of "
                                        r"\['dpo', 'grpo', 'lm', 'medusa', 'sft'"):  # and any a test registers
    from_dict({"train": {"objective": "ppo"}})
  with pytest.raises(ConfigError, match=r"unknown config key 'objective.beta'"):
    from_dict({"objective": {"beta": 0.1}})  # lm has no keys
  with pytest.raises(ConfigError, match=r"train.objective=sft trains on data.format=chat rows, not data.format=text"):
    Trainer(small_config(train={"objective": "sft"}), devices=jax.devices()[:1])


def test_old_dpo_keys_and_chat_lm_configs_migrate():
  old = from_dict({"train": {"objective": "dpo", "dpo_beta": 0.3}, "data": {"format": "preference"}})
  assert old.objective.beta == 0.3 and "dpo_beta" not in old.train.model_dump()
  assert from_dict({"data": {"format": "chat", "source": "bundled-chat"}}).train.objective == "sft"
