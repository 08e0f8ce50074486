"""Long context in training, on 8 simulated devices: context parallelism (ring and
all-gather, zig-zag order) and Megatron sequence parallelism (also with the feed-forward
block in pieces) give the loss and gradients of one device; the compiled step moves K/V
the way its strategy says; per-device activation memory falls with the context size;
tiny-long trains; Llama 3.1 8B at 131k tokens compiles for and fits a v5p slice (libtpu)."""

import importlib.util
import re

import jax
import numpy as np
import pytest

from jaxpar.objectives.lm import lm_loss
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import gradient_temp_bytes, small_config, synthetic_batch

RING, ALL_GATHER = {"context": {"attention": "ring"}}, {"context": {"attention": "all_gather"}}
STRATEGIES = {
  # name: (mesh sizes, parallel section, model options)
  "c4_ring": ({"context": 4, "fsdp": 2}, RING, {}),
  "c4_all_gather_microbatched": ({"context": 4, "fsdp": 2}, ALL_GATHER, {}),
  "c2_f2_t2_ring_sp_remat_mlp2": ({"context": 2, "fsdp": 2, "tensor": 2},
                                  {**RING, "sequence_parallel": True}, {"remat": "full", "mlp_chunks": 2}),
  "f4_t2_sp": ({"fsdp": 4, "tensor": 2}, {"sequence_parallel": True}, {}),
}


def _gradients(config, devices=None):
  """(grads, loss, compiled HLO text) of one step on `config`'s mesh."""
  trainer = Trainer(config, devices=devices)
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in synthetic_batch(config).items()}
  params = trainer.init_state().params
  gradients = jax.jit(make_gradients(lm_loss(trainer.graphdef, z_loss=0.0), microbatches=config.train.microbatches))
  with trainer.context():
    compiled = gradients.lower(params, batch).compile()
  grads, sums, _ = compiled(params, batch)
  return jax.device_get(grads), float(sums["ce_sum"] / sums["tokens"]), compiled.as_text()


@pytest.fixture(scope="module")
def reference():
  return _gradients(small_config(mesh={"fsdp": 1}), jax.devices()[:1])


@pytest.fixture(scope="module", params=sorted(STRATEGIES))
def strategy(request):
  mesh, parallel, model = STRATEGIES[request.param]
  train = {"microbatches": 2} if "microbatched" in request.param else {}
  return request.param, _gradients(small_config(mesh=mesh, model=model, train=train, parallel=parallel))


def test_same_loss_and_grads_as_one_device(strategy, reference):
  name, (grads, loss, _) = strategy
  assert loss == pytest.approx(reference[1], rel=1e-5), name
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(reference[0])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max(),
                               err_msg=f"{name} {jax.tree_util.keystr(path)}")


def _shapes(hlo, kind):
  return re.findall(rf"= (\S+) {kind}(?:-start)?\(", hlo)


# What each strategy's compiled step moves: (one device's K/V block, a whole sequence's K/V,
# how attention crosses the context devices, the residual stream gathered over `tensor`).
# K/V: rows x tokens per device x kv heads per device x 16; the sequence is 32 tokens.
MOVES = {
  "c4_ring": (r"f32\[\d+,8,2,16\]", r"f32\[\d+,32,2,16\]", "ring", None),
  "c4_all_gather_microbatched": (r"f32\[\d+,8,2,16\]", r"f32\[\d+,32,2,16\]", "all_gather", None),
  "c2_f2_t2_ring_sp_remat_mlp2": (r"f32\[\d+,16,1,16\]", r"f32\[\d+,32,1,16\]", "ring", r"f32\[\d+,16,64\]"),
  "f4_t2_sp": (r"f32\[\d+,16,1,16\]", r"f32\[\d+,32,1,16\]", None, r"f32\[\d+,32,64\]"),
}


def test_ring_passes_kv_blocks_and_all_gather_gathers_them(strategy):
  name, (_, _, hlo) = strategy
  block, whole, crossing, residual = MOVES[name]
  block, whole = re.compile(block), re.compile(whole)
  residual = residual and re.compile(residual)
  permuted = [s for s in _shapes(hlo, "collective-permute") if block.match(s)]
  gathered = [s for s in _shapes(hlo, "all-gather") if whole.match(s)]
  if crossing == "ring":
    assert permuted and not gathered, (permuted, gathered)
  elif crossing == "all_gather":
    assert gathered and not permuted, (permuted, gathered)
    assert any(block.match(s) for s in _shapes(hlo, "reduce-scatter"))  # dK, dV
  else:  # no context axis: K/V never leave their device
    assert not permuted and not gathered, (permuted, gathered)
  if residual is not None:  # sequence parallelism gathers the residual stream before its matmuls
    assert any(residual.match(s) for s in _shapes(hlo, "all-gather")), name


def _temp_bytes(context):
  """Compiled temporaries per device: activations kept for the backward (O(L / context))
  plus attention tiles (fixed size): wide enough layers for the first to dominate."""
  model = dict(num_layers=2, embed_dim=256, mlp_dim=1024, head_dim=64, max_seq_len=4096)
  config = small_config(mesh={"context": context, "fsdp": 1}, model=model, parallel=RING,
                        data={"seq_len": 4096, "global_batch_size": 1})
  return gradient_temp_bytes(config, context)


def test_activation_memory_falls_with_context():
  temp = {c: _temp_bytes(c) for c in (1, 2, 4)}
  for c in (2, 4):
    assert temp[c] < 1.15 * temp[1] / c, temp


@pytest.mark.slow
def test_tiny_long_trains_a_few_steps_and_samples(tmp_path, capsys):
  import jaxpar
  from jaxpar.cli import _print_sample
  config = jaxpar.load_config("tiny-long", ["data.seq_len=1024", "train.steps=3", "train.log_every=0",
                                            "train.sample_tokens=4", f"train.run_dir={tmp_path}",
                                            "checkpoint.enabled=false"])
  trainer = jaxpar.Trainer(config)
  result = trainer.fit(show_progress=False)
  assert result.summary["final_loss"] < result.summary["first_loss"] - 0.1, result.summary
  # `jaxpar train`'s closing sample: the engine does not split sequences, so it runs with
  # the context devices folded into fsdp (the trained parameters resharded), not an error.
  _print_sample(trainer, result.state, trainer.tokenizer())
  assert config.train.sample_prompt in capsys.readouterr().out


@pytest.mark.tpu
@pytest.mark.pod_fit
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
def test_llama3_8b_at_131k_tokens_fits_v5p_with_ring_attention():
  """The real TPU compiler (libtpu), one layer of Llama 3.1 8B: 4 x 131,072 tokens on a
  v5p-64 slice, context 8 x fsdp 4, flash kernels passed around the ring."""
  from jaxpar.aot.compile import compile_for_topology
  from jaxpar.config import load_config
  config = load_config("llama3-8b", ["model.num_layers=1", "mesh.context=8", "data.seq_len=131072",
                                     "data.global_batch_size=4", "parallel.context.attention=ring"])
  report, compiled = compile_for_topology(config, "v5p-64")
  assert report["fits"] and report["mesh"] == {"fsdp": 4, "context": 8}, report
  assert {"collective-permute", "all-gather"} <= {row["kind"] for row in report["collectives"]}
  hlo = compiled.as_text()
  # One device's K block (16,384 tokens x 8 kv heads x 128) travels; the whole is never gathered.
  assert re.search(r"collective-permute(-start)?\(.*ppermute", hlo) and "bf16[1,16384,8,128]" in hlo
  assert not re.search(r"bf16\[1,131072,8,128\][^=]*all-gather", hlo)
  assert hlo.count("tpu_custom_call") >= 3  # flash forward, dK/dV and dQ kernels
