"""Config loading, overrides and the one-line errors users see."""

import pytest
import yaml
from pydantic import ValidationError

from jaxpar.cli import main
from jaxpar.config import ConfigError, from_dict, load_config, resolve_config_path, shipped_configs, to_yaml


def test_default_is_tiny_and_overrides_apply():
  config = load_config(None, ["model.num_layers=3", "train.learning_rate=1e-3", "mesh.rules=fsdp"])
  assert config.model.num_layers == 3
  assert config.train.learning_rate == pytest.approx(1e-3)
  assert config.mesh.rules == "fsdp"
  assert config.data.source == "bundled"


def test_config_is_frozen():
  config = load_config("tiny")
  with pytest.raises(ValidationError, match="Instance is frozen"):
    config.model.num_layers = 9
  assert config.model.num_layers == 4


def _leaves(tree, prefix=()):
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      yield from _leaves(value, (*prefix, key))
    else:
      yield (*prefix, key), value


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_shipped_configs_load(name):
  """Every shipped file loads, and every value it writes is the loaded config's."""
  config = load_config(name)
  written = yaml.safe_load(resolve_config_path(name).read_text())
  loaded = config.model_dump(mode="json")
  for path, value in _leaves(written):
    got = loaded
    for key in path:
      got = got[key]
    assert got == (list(value) if isinstance(value, tuple) else value), (name, path)
  assert from_dict(loaded) == config  # and the resolved config loads back as itself


@pytest.mark.parametrize("overrides, message", [
  (["model.bogus=1"], "unknown config key 'model.bogus'"),
  (["model.num_layers=abc"], "model.num_layers='abc'"),
  (["model.num_heads=5"], "model.num_kv_heads=2 must divide model.num_heads=5"),
  (["data.seq_len=4096"], "data.seq_len=4096 exceeds model.max_seq_len=256"),
  (["mesh.tensor=3"], "mesh.tensor=3 does not divide model.num_heads=4"),
  (["mesh.fsdp=-1", "mesh.data=-1"], "only one mesh axis may be -1"),
  (["train.microbatches=5"], "train.microbatches=5 must divide data.global_batch_size=32"),
  (["model.remat=sometimes"], "model.remat='sometimes'"),
  (["model.remat={layer_input: offload}"], "model.remat.layer_input='offload': 'layer_input' is not a named activation"),
  (["model.remat={qkv_proj: keep}"], "model.remat.qkv_proj='keep': use one of save, offload, recompute"),
  (["mesh.xla_flags=sometimes"], "mesh.xla_flags='sometimes': use default, none"),
  (["mesh.xla_flags=[tpu_vmem=1]"], "'tpu_vmem=1' is not a flag: write xla_name=value"),
  (["num_layers"], "is not KEY=VALUE"),
  (["data.source=/no/such/corpus.txt"], "data.source='/no/such/corpus.txt' does not exist"),
  (["data.tokenizer=/no/tokenizer.json"], "data.tokenizer='/no/tokenizer.json' does not exist"),
])
def test_bad_values_give_one_line_naming_the_key(overrides, message):
  with pytest.raises(ConfigError) as error:
    load_config("tiny", overrides)
  assert message in str(error.value)
  assert "\n" not in str(error.value)


def test_missing_config_file_lists_shipped_names():
  with pytest.raises(ConfigError, match="config 'nope.yaml' not found.*tiny"):
    load_config("nope.yaml")


def test_yaml_round_trip(tmp_path):
  config = load_config("llama3.1-8b-v6e-256",
                       ["mesh.fsdp=16", "mesh.xla_flags=[xla_tpu_scoped_vmem_limit_kib=98304]"])
  path = tmp_path / "c.yaml"
  path.write_text(to_yaml(config))
  assert load_config(str(path)) == config


def test_cli_config_show_prints_resolved_config(capsys):
  assert main(["config", "show", "tiny", "model.num_layers=7"]) == 0
  assert "num_layers: 7" in capsys.readouterr().out


def test_cli_bad_override_exits_nonzero_with_one_line(capsys):
  assert main(["config", "show", "tiny", "model.num_heads=3"]) == 2
  err = capsys.readouterr().err
  assert err.strip() == "error: model.num_kv_heads=2 must divide model.num_heads=3"
  assert "Traceback" not in err


def test_cli_help_for_each_command(capsys):
  for args in (["--help"], ["train", "--help"], ["config", "show", "--help"]):
    with pytest.raises(SystemExit) as exit_:
      main(args)
    assert exit_.value.code == 0 and "usage: jaxpar" in capsys.readouterr().out
