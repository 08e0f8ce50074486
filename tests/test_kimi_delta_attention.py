"""Kimi Delta Attention (`model.gated_deltanet.variant: kimi`): the gated_deltanet block with
Kimi Linear's gates equals transformers' KimiLinearDeltaAttention on the same weights, with
packed-free prompts of two rows; its decode, token by token from the recurrent state, equals
its own full forward; and the variant's shape rule is a one-line error."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

from jaxpar.models import caches
from jaxpar.models.config import ModelConfig
from jaxpar.models.decoder import LayerContext
from jaxpar.models.gated_deltanet import GatedDeltaNet
from jaxpar.models.recurrent_state import RecurrentState, init_states

EMBED, HEADS, DIM, TAPS, LENGTH = 64, 2, 16, 4, 24


def _layers():
  torch.manual_seed(0)
  hf_config = KimiLinearConfig(hidden_size=EMBED, num_hidden_layers=1, layer_types=["linear_attention"],
                               linear_attn_config={"head_dim": DIM, "num_heads": HEADS, "short_conv_kernel_size": TAPS},
                               rms_norm_eps=1e-5)
  hf = KimiLinearDeltaAttention(hf_config, layer_idx=0).float().eval()
  with torch.no_grad():  # transformers leaves these to its _init_weights: give them values
    hf.forget_gate.A_log.copy_(torch.log(torch.empty(1, 1, HEADS, 1).uniform_(1.0, 16.0)))
    hf.forget_gate.dt_bias.copy_(torch.randn(HEADS * DIM) * 0.5)
    hf.o_norm.weight.copy_(1 + 0.1 * torch.randn(DIM))
  cfg = ModelConfig(embed_dim=EMBED, norm_eps=1e-5, gated_deltanet={
      "num_key_heads": HEADS, "num_value_heads": HEADS, "key_head_dim": DIM, "value_head_dim": DIM,
      "conv_kernel": TAPS, "chunk_size": 8, "variant": "kimi"})
  with nnx.use_eager_sharding(False):  # as build_model builds it: jaxpar places parameters itself
    ours = GatedDeltaNet(cfg, param_dtype=jnp.float32, compute_dtype=jnp.float32, rngs=nnx.Rngs(0))
  weight = lambda module: module.weight.detach().numpy()  # noqa: E731  [out, in]
  heads = lambda w: w.T.reshape(-1, HEADS, DIM)  # noqa: E731  [heads * dim, in] -> [in, heads, dim]
  conv = weight(hf.conv1d)[:, 0, :]  # [3 * heads * dim, taps], q then k then v channels
  for i, name in enumerate("qkv"):
    getattr(ours, name)[...] = heads(weight(getattr(hf, f"{name}_proj")))
    getattr(ours, f"conv_{name}")[...] = conv[i * HEADS * DIM:(i + 1) * HEADS * DIM].reshape(HEADS, DIM, TAPS).transpose(2, 0, 1)
  ours.b[...] = weight(hf.b_proj).T
  ours.f_a[...], ours.f_b[...] = weight(hf.forget_gate.f_a_proj).T, heads(weight(hf.forget_gate.f_b_proj))
  ours.g_a[...], ours.g_b[...] = weight(hf.g_a_proj).T, heads(weight(hf.g_b_proj))
  ours.dt_bias[...] = hf.forget_gate.dt_bias.detach().numpy().reshape(HEADS, DIM)
  ours.a_log[...] = hf.forget_gate.A_log.detach().numpy().reshape(HEADS)
  ours.norm.scale[...] = weight(hf.o_norm)
  ours.o[...] = weight(hf.o_proj).T.reshape(HEADS, DIM, EMBED)
  return hf, ours


def test_equals_transformers_kimi_delta_attention_and_decodes_as_it_runs_whole():
  hf, ours = _layers()
  x = np.random.default_rng(1).normal(size=(2, LENGTH, EMBED)).astype(np.float32)
  with torch.no_grad():
    want = hf(torch.from_numpy(x)).numpy()
  positions = jnp.broadcast_to(jnp.arange(LENGTH), (2, LENGTH))
  got, _ = ours(jnp.asarray(x), LayerContext(positions), caches.NoCache(), None)
  np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)

  # Generation: the prompt's first 17 tokens at once, then one token at a time from the state.
  model_cfg = ModelConfig(embed_dim=EMBED, norm_eps=1e-5, gated_deltanet=ours.options.model_dump())
  cache = RecurrentState(init_states(model_cfg, 1, 2, jnp.float32), jnp.arange(2, dtype=jnp.int32),
                         jnp.asarray(0, jnp.int32))
  outs = []
  for start, end in ((0, 17),) + tuple((t, t + 1) for t in range(17, LENGTH)):
    out, cache = ours(jnp.asarray(x[:, start:end]), LayerContext(positions[:, start:end]), cache, None)
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), got, rtol=2e-4, atol=2e-5)


def test_the_variant_needs_one_key_head_per_value_head_of_one_size():
  with pytest.raises(ValueError, match="variant=kimi has one key head per value head, of one size"):
    ModelConfig(gated_deltanet={"num_key_heads": 2, "num_value_heads": 4, "variant": "kimi"})
