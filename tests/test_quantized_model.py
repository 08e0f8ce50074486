"""Quantized models run through the same model code: float parameter paths unchanged,
quantized ones keep the logical names (so they shard like the originals), bytes checked on
the arrays, and `jaxpar quantize` writes a checkpoint that restores onto any mesh."""

import jax
import numpy as np
import pytest

from jaxpar import cli
from jaxpar.checkpoint import Checkpointer
from jaxpar.pallas_kernels import QuantizedWeight, dequantize_weight
from jaxpar.config import ConfigError, replace
from jaxpar.convert.quantize import quantization_section
from jaxpar.weights import quantize_params
from jaxpar.runtime import Runtime
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config

MODEL = {"head_dim": 32}  # int4 groups of 32 divide embed (64), head_dim and mlp (128)
TOKENS = np.random.default_rng(0).integers(0, 258, (4, 32)).astype(np.int32)
PROJECTIONS = [("attn", "q"), ("attn", "k"), ("attn", "v"), ("attn", "o"), ("mlp", "gate"),
               ("mlp", "up"), ("mlp", "down")]


def _quantized(config, mode, group=None, **section):
  return replace(config, model={"quantization": {**quantization_section(mode, group), **section}})


def _logits(config, params, devices=None):
  runtime = Runtime(config.model, config.mesh, devices)
  params = jax.device_put(params, runtime.param_shardings)
  with runtime.context():
    return np.asarray(jax.jit(lambda p, t: runtime.merge(p)(t)[0])(params, TOKENS))


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
  """A random-weight float model (8-device fsdp) saved the way training saves it."""
  config = small_config(model=MODEL)
  runtime = Runtime(config.model, config.mesh)
  params = runtime.init()[0]
  root = tmp_path_factory.mktemp("float") / "checkpoints"
  with Checkpointer(root) as checkpoints:
    checkpoints.save(5, {"params": params}, config=config, force=True)
  return config, root, jax.device_get(params)


def test_paths_logical_names_and_bytes(float_checkpoint):
  config = float_checkpoint[0]
  mesh = {"mesh": {"fsdp": 4, "tensor": 2, "rules": "fsdp_tp"}}
  float_rt = Runtime(replace(config, **mesh).model, replace(config, **mesh).mesh)
  q4 = _quantized(replace(config, **mesh), "int4", 32, zero_point=True)
  q4_rt = Runtime(q4.model, q4.mesh)
  assert isinstance(float_rt.abstract_params["layers"]["attn"]["q"], jax.ShapeDtypeStruct)
  q = q4_rt.abstract_params["layers"]["attn"]["q"]
  assert sorted(q) == ["scales", "values", "zeros"]
  # values [layers, embed, heads, head_dim] and o's [layers, heads, head_dim / 2, embed]
  # split like the float kernels: heads over tensor, embed over fsdp.
  for layer, name in (("attn", "q"), ("attn", "o"), ("mlp", "down")):
    want = float_rt.param_shardings["layers"][layer][name].spec
    assert q4_rt.param_shardings["layers"][layer][name]["values"].spec == want
  assert q4_rt.param_shardings["layers"]["attn"]["o"]["scales"].spec[1] == "tensor"
  # Scales are float32: 4 bytes per output channel and K rows (int8; K >= 64 here) or per
  # group of 32 rows (int4), i.e. 2 / rows of the bf16 bytes on top of the values.
  for mode, group, values_ratio, total_ratio in (("int8", None, 1 / 2, 1 / 2 + 2 / 64),
                                                 ("int4", 32, 1 / 4, 1 / 4 + 2 / 32)):
    rt = Runtime(_quantized(config, mode, group).model, config.mesh)
    bf16 = sum(float_rt.abstract_params["layers"][a][b].size * 2 for a, b in PROJECTIONS)
    arrays = [rt.abstract_params["layers"][a][b] for a, b in PROJECTIONS]
    values = sum(p["values"].size * p["values"].dtype.itemsize for p in arrays)
    total = sum(x.size * x.dtype.itemsize for p in arrays for x in p.values())
    assert values == bf16 * values_ratio and values < total <= bf16 * total_ratio, (mode, total / bf16)


def test_quantize_command_restores_onto_any_mesh(float_checkpoint, tmp_path):
  config, root, params = float_checkpoint
  out = tmp_path / "int4"
  # No --group-size: the default is the widest group the model's dims take (32 here, not 128).
  assert cli.main(["quantize", str(root), str(out), "--mode", "int4"]) == 0
  with Checkpointer(out, read_only=True) as written:
    assert written.all_steps() == [5]
    saved = written.saved_config()["model"]["quantization"]
  assert saved["mode"] == "int4" and saved["group_size"] == 32
  q_config = _quantized(config, "int4", 32)
  want = jax.device_get(quantize_params(params, Runtime(q_config.model, q_config.mesh)))
  reference_logits = _logits(config, params)  # float
  results = []
  for mesh, devices, impl in (({"fsdp": 8}, None, "xla"), ({"fsdp": 4, "tensor": 2}, None, "pallas"),
                              ({"fsdp": 1}, jax.devices()[:1], "xla")):
    target = replace(q_config, mesh=mesh, model={"quantization": {**saved, "implementation": impl}})
    runtime = Runtime(target.model, target.mesh, devices)
    with Checkpointer(out, read_only=True) as checkpoints:
      restored = runtime.restore(checkpoints, checkpoints.pick_step())[0]
    for a, b in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)
    results.append(_logits(target, restored, devices))
  for logits in results[1:]:  # the Pallas kernels per device (tensor 2) agree with XLA
    np.testing.assert_allclose(logits, results[0], rtol=1e-5, atol=1e-5)
  # The quantized model computes exactly what the float model does on the dequantized weights.
  dequantized = _dequantized(params, want)
  np.testing.assert_allclose(results[0], _logits(config, dequantized), rtol=1e-5, atol=1e-5)
  assert not np.allclose(results[0], reference_logits, atol=1e-3)


def _dequantized(params, quantized, group=32):
  """The float params with every projection replaced by its int4 round trip."""
  out = jax.tree.map(lambda x: x, params)
  for layer, name in PROJECTIONS:
    w, q = params["layers"][layer][name], quantized["layers"][layer][name]
    contract = 2 if name == "o" else 1
    k = int(np.prod(w.shape[1:1 + contract]))

    def one(values, scales):
      weight = QuantizedWeight(values.reshape(k // 2, -1), scales.reshape(k // group, -1),
                               mode="int4", group_size=group)
      return dequantize_weight(weight)

    out["layers"][layer][name] = jax.vmap(one)(q["values"], q["scales"]).reshape(w.shape)
  return out


def test_mistakes_are_one_line_errors(float_checkpoint, tmp_path):
  config, root, _ = float_checkpoint
  with pytest.raises(ConfigError, match="group_size=64 does not divide model.head_dim=32"):
    _quantized(config, "int4", 64)
  with pytest.raises(ConfigError, match="group_size / zero_point apply to mode=int4 only"):
    replace(config, model={"quantization": {"mode": "int8", "group_size": 32}})
  with pytest.raises(ValueError, match="quantized weights are for inference"):
    Trainer(_quantized(config, "int8"))
  out = tmp_path / "w8a8"
  assert cli.main(["quantize", str(root), str(out), "--mode", "w8a8"]) == 0
  assert cli.main(["quantize", str(root), str(out), "--mode", "int8"]) == 2  # out not empty
  assert cli.main(["quantize", str(out), str(tmp_path / "again"), "--mode", "int8"]) == 2
  assert cli.main(["quantize", str(root), str(tmp_path / "x"), "--mode", "int8", "--group-size", "32"]) == 2
