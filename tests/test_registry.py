"""The open architecture: a family and blocks added through the registry alone, auxiliary
losses leaving the scanned stack for the objective and the metrics, and non-parameter
model variables that the optimizer never touches but checkpoints keep."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import ModelConfig, from_dict
from jaxpar.train.loss import causal_lm_loss
from jaxpar.models import (MLP, Attention, LayerKind, ModelFamily, Transformer, build_model, register_block,
                           register_family)
from jaxpar.models.flops import dense_train_flops_per_token
from jaxpar.objectives.lm import lm_loss
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import SMALL_MODEL, reference_decoder_logits, synthetic_batch


class TokenCount(nnx.Variable):
  """Not a parameter: how many token positions a layer has seen."""


class ProbeMLP(nnx.Module):
  """A dense MLP that adds an auxiliary loss (weight x mean square of its output), reports
  a metric, and counts the positions it sees in a non-parameter variable."""

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs):
    self.inner = MLP(cfg.embed_dim, cfg.mlp_dim, param_dtype=param_dtype,
                     compute_dtype=compute_dtype, rngs=rngs)
    self.seen = TokenCount(jnp.zeros((), jnp.float32))
    self.weight = cfg.probe_weight

  def __call__(self, x):
    y, _ = self.inner(x)
    self.seen[...] = self.seen[...] + x.shape[0] * x.shape[1]
    square = jnp.mean(jnp.square(y.astype(jnp.float32)))
    return y, {"losses": {"probe": self.weight * square}, "metrics": {"probe_rms": jnp.sqrt(square)}}


class GeluMLP(nnx.Module):
  """A plain two-matrix GELU MLP: a block the llama family does not have."""

  def __init__(self, cfg, *, param_dtype, compute_dtype, rngs):
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Param(init(rngs.params(), (cfg.embed_dim, cfg.mlp_dim), param_dtype),
                        out_sharding=("embed", "mlp"))
    self.down = nnx.Param(init(rngs.params(), (cfg.mlp_dim, cfg.embed_dim), param_dtype),
                          out_sharding=("mlp", "embed"))
    self.dtype = compute_dtype

  def __call__(self, x):
    return jax.nn.gelu(x @ self.up[...].astype(self.dtype)) @ self.down[...].astype(self.dtype), {}


class ToyConfig(ModelConfig):
  """The toy family's own config section: one extra field."""
  probe_weight: float = 0.1


class NoRopeAttention(Attention):
  """The gqa block without rotary embeddings (NoPE): order comes from the causal mask alone."""

  def embed_positions(self, q, k, positions, rope):
    return q, k


class LocalGlobalConfig(ModelConfig):
  """A family whose layers alternate a window of 8 keys with full attention, by default."""
  layer_pattern: tuple[LayerKind, ...] = (LayerKind(sliding_window=8), LayerKind())


register_block("feed_forward", "probe", ProbeMLP)
register_block("feed_forward", "gelu", GeluMLP)
register_block("attention", "nope", NoRopeAttention)
register_family(ModelFamily(name="toy", module=Transformer, config=ToyConfig,
                            flops_per_token=dense_train_flops_per_token, rules="fsdp_tp"))
register_family(ModelFamily(name="toy_local_global", module=Transformer, config=LocalGlobalConfig,
                            flops_per_token=dense_train_flops_per_token))


def _config(model=None, mesh=None, train=None, tmp_path=None):
  return from_dict({
    "model": {**SMALL_MODEL, "family": "toy", "mlp": "probe", **(model or {})},
    "mesh": {"fsdp": -1, **(mesh or {})},
    "data": {"seq_len": 32, "global_batch_size": 8},
    "train": {"steps": 2, "warmup_steps": 1, "log_every": 0,
              "run_dir": str(tmp_path / "run") if tmp_path else "runs/test", **(train or {})},
    "checkpoint": {"enabled": tmp_path is not None, "async_save": False},
  })


def test_a_family_and_block_from_the_registry_train(tmp_path):
  config = _config(model={"mlp": "gelu", "first_dense_layers": 1, "probe_weight": 0.3},
                   tmp_path=tmp_path)
  assert type(config.model) is ToyConfig and config.model.probe_weight == 0.3
  trainer = Trainer(config)
  params = trainer.runtime.abstract_params
  # A mixed stack scans per group: one dense layer (SwiGLU gate), then gelu layers.
  assert params["dense_layers"]["mlp"]["gate"].shape == (1, 64, 128)
  assert set(params["layers"]["mlp"]) == {"up", "down"} and params["layers"]["mlp"]["up"].shape[0] == 1
  result = trainer.fit(show_progress=False)
  assert [h["step"] for h in result.history] == [1, 2]
  # The trained model computes what its blocks say: a float64 decoder with one SwiGLU layer,
  # then the registered gelu block's up/down (GELU's tanh form, jax.nn.gelu's default).
  model = nnx.merge(trainer.graphdef, result.state.params, result.state.model_state)
  tokens = np.asarray(synthetic_batch(config)["inputs"][:2])
  got = np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, jnp.asarray(tokens)), np.float64)
  gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))  # noqa: E731
  params = jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  want = reference_decoder_logits(params, tokens, mlps={"layers": lambda m, h: gelu(h @ m["up"]) @ m["down"]})
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_an_attention_block_and_a_layer_pattern_from_the_registry_train():
  config = _config(model={"family": "toy_local_global", "attention_block": "nope", "mlp": "dense",
                          "num_layers": 3})
  assert [k.sliding_window for k in config.model.layer_pattern] == [8, None]
  trainer = Trainer(config)
  assert trainer.runtime.abstract_params["layers"]["attn"]["q"].shape[0] == 3  # still one stack
  result = trainer.fit(show_progress=False)
  assert [h["step"] for h in result.history] == [1, 2] and all(np.isfinite(h["loss"]) for h in result.history)
  # The block is the one registered: without RoPE, positions change nothing; the pattern's
  # window on layers 0 and 2 is honoured: a token 20 back matters only through layer 1.
  model = build_model(config.model, nnx.Rngs(0))
  tokens = jnp.asarray(synthetic_batch(config)["inputs"][:2])
  run = nnx.jit(lambda m, t, p: m(t, p)[0])
  shuffled = jnp.asarray(np.random.default_rng(1).permutation(32))[None].repeat(2, 0)
  np.testing.assert_allclose(run(model, tokens, None), run(model, tokens, shuffled), rtol=1e-5, atol=1e-5)
  windowed = build_model(config.model.model_copy(update={"layer_pattern": (LayerKind(sliding_window=8),)}),
                         nnx.Rngs(0))
  changed = tokens.at[:, 0].set((tokens[:, 0] + 1) % 258)
  assert not np.allclose(run(model, tokens, None)[:, 30], run(model, changed, None)[:, 30], atol=1e-4)
  np.testing.assert_allclose(run(windowed, tokens, None)[:, 30], run(windowed, changed, None)[:, 30],
                             rtol=1e-5, atol=1e-5)


def test_unknown_family_and_block_are_one_line_errors():
  from jaxpar.config import ConfigError
  with pytest.raises(ConfigError, match=r"model.family='gpt9' is not a registered family; use one of \["):
    _config(model={"family": "gpt9"})
  with pytest.raises(ConfigError, match="model.mlp='nope' is not a registered feed_forward block"):
    _config(model={"mlp": "nope"})
  with pytest.raises(ConfigError, match=r"model.attention_block='sparse' is not a registered attention block; "
                                        r"use one of \['gated_deltanet', 'gemma4', 'gemma4_global', 'gemma4_global_shared', 'gemma4_shared', 'gqa', 'mla', 'nope'\]"):
    _config(model={"attention_block": "sparse"})
  with pytest.raises(ConfigError, match=r"model.layer_pattern\[1\].mixer='sparse' is not a registered attention block"):
    _config(model={"layer_pattern": [{}, {"mixer": "sparse"}]})
  with pytest.raises(ConfigError, match="model.layer_block='sandwich' is not a registered decoder_layer block"):
    _config(model={"layer_block": "sandwich"})
  with pytest.raises(ConfigError, match="unknown config key 'model.probe_weight'"):
    from_dict({"model": {"probe_weight": 0.1}})  # a field of the toy family only


@pytest.fixture(scope="module")
def probe_run():
  """One batch, the probe family on 8 devices (fsdp4 x tp2), and its parameters."""
  config = _config(mesh={"fsdp": 4, "tensor": 2})
  trainer = Trainer(config)
  state = trainer.init_state()
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in synthetic_batch(config).items()}
  return trainer, state, batch


def test_aux_losses_reach_objective_and_metrics_with_microbatches(probe_run):
  trainer, state, batch = probe_run
  host_batch = jax.device_get(batch)

  def by_hand(params):  # CE mean + the summed auxiliary losses, on one device
    model = nnx.merge(trainer.graphdef, params, jax.device_get(state.model_state))
    logits, aux = model(host_batch["inputs"], host_batch["positions"], host_batch["segment_ids"])
    _, sums = causal_lm_loss(logits, host_batch["targets"], host_batch["loss_mask"])
    return sums["ce_sum"] / sums["tokens"] + sum(aux["losses"].values()), aux
  params = jax.device_get(state.params)
  (_, aux), want = jax.jit(jax.value_and_grad(by_hand, has_aux=True))(params)
  assert set(aux["losses"]) == {"probe"} and set(aux["metrics"]) == {"probe_rms"}

  gradients = jax.jit(make_gradients(lm_loss(trainer.graphdef, z_loss=0.0), microbatches=2))
  with trainer.context():
    grads, sums, _ = gradients(state.params, batch, state.model_state)
  tokens = float(sums["tokens"])
  np.testing.assert_allclose(float(sums["loss/probe"]) / tokens, float(aux["losses"]["probe"]), rtol=1e-5)
  # A root of a mean is not linear: over microbatches it is their token-weighted average.
  np.testing.assert_allclose(float(sums["metric/probe_rms"]) / tokens, float(aux["metrics"]["probe_rms"]),
                             rtol=1e-3)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(grads)), jax.tree.leaves(want)):
    np.testing.assert_allclose(g / tokens, w, rtol=1e-4, atol=1e-5 * np.abs(w).max(),
                               err_msg=jax.tree_util.keystr(path))

  config = trainer.config.model_copy(update={"train": trainer.config.train.model_copy(
      update={"microbatches": 2})})
  _, metrics = Trainer(config).step(jax.tree.map(jnp.copy, state), batch)
  assert {"loss/probe", "probe_rms"} <= set(metrics)
  np.testing.assert_allclose(float(metrics["loss/probe"]), float(aux["losses"]["probe"]), rtol=1e-5)


def test_model_state_is_not_optimized_or_decayed_and_is_checkpointed(tmp_path):
  config = _config(train={"steps": 3, "weight_decay": 0.5, "learning_rate": 0.1}, tmp_path=tmp_path)
  trainer = Trainer(config)
  assert "seen" not in str(jax.tree_util.tree_structure(trainer.abstract_state().opt_state))
  result = trainer.fit(steps=2, show_progress=False)
  positions = config.data.global_batch_size * config.data.seq_len
  seen = result.state.model_state["layers"]["mlp"]["seen"]
  np.testing.assert_array_equal(np.asarray(seen), [2 * positions] * config.model.num_layers)
  with Checkpointer(tmp_path / "run" / "checkpoints", read_only=True) as checkpoints:
    items, _ = checkpoints.restore(trainer.abstract_state().items())
  np.testing.assert_array_equal(np.asarray(items["model_state"]["layers"]["mlp"]["seen"]), np.asarray(seen))
  resumed = Trainer(config).fit(show_progress=False)  # picks up step 2, model_state included
  np.testing.assert_array_equal(np.asarray(resumed.state.model_state["layers"]["mlp"]["seen"]),
                                [3 * positions] * config.model.num_layers)
