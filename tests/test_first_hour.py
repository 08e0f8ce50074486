"""The rough edges a newcomer hit in their first hour (issue 25): a quiet `import jaxpar`,
two topology compiles at once, quiet checkpoint opens, clear refusals (a negative learning
rate, training a quantized checkpoint, a mesh bigger than the devices, an HF model with no
tokenizer), no warning for a batch of one, and byte-level models exported with a tokenizer
that `transformers` loads and that encodes as jaxpar's does."""

import io
import logging
import os
import subprocess
import sys

import jax
import pytest

from jaxpar.checkpoint import Checkpointer
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.errors import CheckpointError, ConfigError
from jaxpar.runtime import Runtime
from tests.helpers import small_config

TEXTS = ["Hello, world!", "  two  spaces\n\ttab", "naïve café 日本語 🙂", "<|endoftext|> is text here", ""]


def _python(code: str, env_drop=("JAX_PLATFORMS",), **kwargs):
  env = {k: v for k, v in os.environ.items() if k not in env_drop}
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                        **kwargs)


@pytest.mark.parametrize("code", ["import jaxpar, jax; print(jax.devices())",
                                  "import jax, jaxpar; print(jax.devices())"])  # jax imported first too
def test_import_jaxpar_is_quiet_on_a_host_without_accelerators(code):
  result = _python(code)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "CpuDevice" in result.stdout
  assert "TPU" not in result.stderr and "libtpu" not in result.stderr and "E0000" not in result.stderr, result.stderr


@pytest.mark.tpu
def test_two_topology_compiles_at_once_on_one_host():
  """libtpu's lockfile let only one process describe a topology; a host with no TPU has
  nothing to share, so the second must work too (no ALLOW_MULTIPLE_LIBTPU_LOAD given)."""
  describe = "from jaxpar.aot.chips import topology_devices; print(len(topology_devices('v5e-4')[1]), flush=True)"
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
  first = subprocess.Popen([sys.executable, "-c", describe + "; import sys; sys.stdin.read()"], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert first.stdout.readline().strip() == "4"  # the first holds libtpu from here on
    second = _python(describe, env_drop=("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD"))
    assert second.returncode == 0 and second.stdout.strip() == "4", second.stderr[-2000:]
  finally:
    first.communicate("", timeout=60)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A small byte-level model's parameters saved at step 5 with its config."""
  root = tmp_path_factory.mktemp("first_hour")
  config = small_config(tmp_path=root)
  params, _ = Runtime.from_config(config).create()
  with Checkpointer(root / "ckpt") as checkpoints:
    checkpoints.save(5, {"params": params}, config=config, force=True)
  return root, config


def test_opening_a_checkpoint_logs_no_warnings(saved, caplog):
  from jaxpar.weights import SavedRun
  root, _ = saved
  with caplog.at_level(logging.INFO), SavedRun(root / "ckpt") as run:
    assert run.step == 5
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_negative_learning_rate_is_refused():
  with pytest.raises(ConfigError, match="train.learning_rate=-1: Input should be greater than 0"):
    load_config("tiny", ["train.learning_rate=-1"])


def test_training_from_a_quantized_checkpoint_is_a_clear_refusal(saved, tmp_path):
  from jaxpar.convert.quantize import quantize_checkpoint
  from jaxpar.train.trainer import Trainer
  root, config = saved
  _, quantized = quantize_checkpoint(root / "ckpt", tmp_path / "int8", "int8")
  with pytest.raises(CheckpointError, match=r"is quantized \(model.quantization.mode=int8\): quantized "
                     "weights are for inference; train from the float checkpoint"):
    Trainer(small_config(tmp_path=tmp_path)).fit(restore=quantized, show_progress=False)


def test_an_engine_mesh_bigger_than_the_devices_says_so(saved):
  from jaxpar.inference import Engine
  root, _ = saved
  with pytest.raises(ConfigError, match="mesh tensor=8 needs a multiple of 8 devices but 1 is available"):
    Engine.from_checkpoint(root / "ckpt", mesh={"tensor": 8}, devices=jax.devices()[:1])


def test_a_batch_of_one_is_replicated_without_a_warning(caplog):
  from jaxpar.mesh import build_mesh, logical_to_spec, resolve_rules
  config = small_config()
  mesh, rules = build_mesh(config.mesh), resolve_rules(config.mesh.rules)
  with caplog.at_level(logging.WARNING):
    assert logical_to_spec(("batch", "length"), (1, 16), mesh, rules) == jax.sharding.PartitionSpec(None, None)
    assert "replicating" not in caplog.text
    logical_to_spec(("batch", "length"), (6, 16), mesh, rules)  # a batch the user could size to divide
  assert "replicating logical axis 'batch' (size 6)" in caplog.text


def test_a_byte_level_export_brings_a_tokenizer_that_encodes_byte_for_byte(saved, tmp_path):
  transformers = pytest.importorskip("transformers")
  from jaxpar.convert.hf import jaxpar_to_hf
  from jaxpar.data import ByteTokenizer, load_tokenizer
  root, _ = saved
  jaxpar_to_hf(root / "ckpt", tmp_path / "hf")
  theirs, ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf"), ByteTokenizer()
  for text in TEXTS:
    assert theirs.encode(text) == ours.encode(text), text
    assert theirs.decode(ours.encode(text)) == text
  assert (theirs.eos_token_id, theirs.bos_token_id) == (ours.eos_id, ours.bos_id)
  # jaxpar reads it back the same way (its HF tokenizer, like the tokenizers library, takes a
  # special token's text in a prompt as that token: texts without one).
  reread, plain = load_tokenizer(str(tmp_path / "hf")), [t for t in TEXTS if "<|" not in t]
  assert [reread.encode(t) for t in plain] == [ours.encode(t) for t in plain] and reread.eos_id == ours.eos_id


def test_an_hf_model_without_a_tokenizer_is_named_at_convert_and_refused_at_generate(tmp_path, capsys):
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from jaxpar.inference import Engine
  from jaxpar.weights import open_run
  from tests.test_hf import SMALL, _random_hf_model
  _random_hf_model(transformers.LlamaConfig(**SMALL), tmp_path / "hf")
  assert main(["convert", "hf-to-jaxpar", str(tmp_path / "hf"), str(tmp_path / "bare")]) == 0
  said = capsys.readouterr().err
  assert "WARNING" in said and "has no tokenizer.json" in said and "--tokenizer PATH" in said, said
  with pytest.raises(CheckpointError, match="imported without a tokenizer.*--tokenizer PATH"):
    Engine.from_run(open_run(tmp_path / "bare"), slots=1)
  assert main(["convert", "hf-to-jaxpar", str(tmp_path / "hf"), str(tmp_path / "x"),
               "--tokenizer", str(tmp_path / "nowhere")]) == 2
  assert not (tmp_path / "x").exists()  # refused before anything was written
  assert main(["convert", "hf-to-jaxpar", str(tmp_path / "hf"), str(tmp_path / "bytes"), "--tokenizer", "byte"]) == 0
  assert open_run(tmp_path / "bytes").tokenizer.encode("hi") == [104, 105]


def test_launch_local_passes_the_output_on_without_gloo_connection_banners(capfd):
  from jaxpar.cluster.launch_local import launch_local
  job = ("from jaxpar.cluster import distributed; distributed.initialize()\n"
         "import jax.numpy as jnp; from jax.experimental import multihost_utils\n"
         "total = multihost_utils.process_allgather(jnp.ones(1)).sum()\n"
         "import jax; print(f'process {jax.process_index()} sees {total:.0f}')")
  assert launch_local(2, [sys.executable, "-c", job], devices_per_process=2, echo=lambda _: None) == 0
  out = capfd.readouterr().out
  assert "process 0 sees 2" in out and "process 1 sees 2" in out, out
  assert "[Gloo]" not in out, out  # gloo prints one per connection it makes: nothing to act on


def test_banners_that_gloo_threads_interleave_into_one_line_are_dropped_too():
  """Two of gloo's threads write at once: their banners can share one line (seen in CI)."""
  from jaxpar.cluster.launch_local import _forward
  garbled = (b"[Gloo] Rank [Gloo] Rank 1 is connected to 11 is connected to  peer ranks. 1Expected number of "
             b"connected peer ranks is :  peer ranks. 1Expected number of connected peer ranks is : 1\n"
             b"process 0 sees 2\n")
  out = io.BytesIO()
  _forward(io.BufferedReader(io.BytesIO(garbled)), out)
  assert out.getvalue() == b"process 0 sees 2\n"


class _Chunks(io.RawIOBase):
  """A pipe that hands out the writes it was given one by one, as a process's output arrives."""

  def __init__(self, writes):
    self.writes = list(writes)

  def read1(self, _size=-1):
    return self.writes.pop(0) if self.writes else b""


def test_a_banner_remnant_after_streamed_tokens_is_dropped_and_the_tokens_kept():
  """Seen in CI: `generate` streamed "the dog" without a newline, then the tail of an
  interleaved banner arrived, and its newline ended the tokens' line."""
  from jaxpar.cluster.launch_local import _forward
  for writes in ([b"the dog", b"Expected number of connected peer ranks is : 7\n", b"{w{c!b\n"],
                 [b"the dogExpected number of conn", b"ected peer ranks is : 7\n{w{c!b\n"]):
    out = io.BytesIO()
    _forward(_Chunks(writes), out)
    assert out.getvalue() == b"the dog{w{c!b\n", writes
