"""`model.mlp_chunks`: the feed-forward block run over the sequence in pieces gives the same
logits and gradients as the whole block, and the compiled step's temporaries fall (the
[tokens, mlp_dim] intermediates of the backward are one piece's). With context and tensor
parallelism it is checked in test_long_context_train.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.models import build_model
from tests.helpers import SMALL_MODEL, gradient_temp_bytes, small_config

TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 258, (2, 24)), jnp.int32)


def _model(**overrides):
  return build_model(ModelConfig(**{**SMALL_MODEL, **overrides}), nnx.Rngs(0))


@pytest.mark.parametrize("remat", ["full", {"decoder_layer_input": "offload", "mlp_in": "save"}])
def test_pieces_give_the_whole_blocks_logits_and_gradients(remat):
  whole, pieces = _model(remat=remat), _model(remat=remat, mlp_chunks=3)
  loss = lambda m: jnp.mean(m(TOKENS)[0] ** 2)  # noqa: E731
  for a, b in zip(jax.tree.leaves(nnx.jit(nnx.grad(loss))(pieces)),
                  jax.tree.leaves(nnx.jit(nnx.grad(loss))(whole))):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # 5 positions do not split in 3: that call runs whole, with the same result.
  logits = lambda m: nnx.jit(lambda m: m(TOKENS[:, :5])[0])(m)  # noqa: E731
  np.testing.assert_allclose(logits(pieces), logits(whole), rtol=1e-6, atol=1e-6)


def _temp_bytes(chunks):
  model = dict(num_layers=2, embed_dim=128, mlp_dim=2048, remat="full", mlp_chunks=chunks,
               max_seq_len=2048)
  config = small_config(mesh={"fsdp": 1}, model=model, data={"seq_len": 2048, "global_batch_size": 2})
  return gradient_temp_bytes(config, 1)


def test_pieces_cut_the_backward_peak():
  whole, quarters = _temp_bytes(1), _temp_bytes(4)
  # One [4096, 2048] f32 intermediate is 32 MiB; the whole block's backward holds several.
  assert quarters < 0.6 * whole, (quarters, whole)


def test_pieces_must_divide_each_devices_positions():
  with pytest.raises(ValueError, match="model.mlp_chunks=3 does not divide"):
    small_config(model={"mlp_chunks": 3}, data={"seq_len": 32})
