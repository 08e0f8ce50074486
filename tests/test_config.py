"""Config loading, overrides and the one-line errors users see."""

import subprocess
import sys

import pytest

from jaxpar.config import ConfigError, load_config, shipped_configs, to_yaml


def test_default_is_tiny_and_overrides_apply():
  config = load_config(None, ["model.num_layers=3", "train.learning_rate=1e-3", "mesh.rules=fsdp"])
  assert config.model.num_layers == 3
  assert config.train.learning_rate == pytest.approx(1e-3)
  assert config.mesh.rules == "fsdp"
  assert config.data.source == "bundled"


def test_config_is_frozen():
  config = load_config("tiny")
  with pytest.raises(Exception):
    config.model.num_layers = 9


@pytest.mark.parametrize("name", ["tiny", "bench-20m", "bench-50m", "llama3-8b", "llama3-70b",
                                  "llama2-7b", "mistral-7b", "qwen2.5-7b", "llama3.1-8b-v6e-256",
                                  "llama3.1-70b-v6e-256", "llama2-70b-v5p-512"])
def test_shipped_configs_load(name):
  assert name in shipped_configs()
  config = load_config(name)
  assert config.model.num_heads % config.model.num_kv_heads == 0
  assert load_config(None, []) != config or name == "tiny"


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


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "jaxpar", *args], capture_output=True, text=True,
                        timeout=120)


def test_cli_config_show_prints_resolved_config():
  result = _cli("config", "show", "tiny", "model.num_layers=7")
  assert result.returncode == 0, result.stderr
  assert "num_layers: 7" in result.stdout


def test_cli_bad_override_exits_nonzero_with_one_line():
  result = _cli("config", "show", "tiny", "model.num_heads=3")
  assert result.returncode == 2
  assert result.stderr.strip() == "error: model.num_kv_heads=2 must divide model.num_heads=3"
  assert "Traceback" not in result.stderr


def test_cli_help_for_each_command():
  for args in (["--help"], ["train", "--help"], ["config", "show", "--help"]):
    result = _cli(*args)
    assert result.returncode == 0 and "usage: jaxpar" in result.stdout
