"""DeepSeek-V3 (multi-head latent attention, node-limited sigmoid routing, shared + routed
experts, dense first layers): a random-weight transformers DeepseekV3 at small, unusual
shapes imports with f32 logits parity and exports bit-exact; the engine's latent cache
generates greedily what transformers.generate does; a train step on 8 simulated devices
(fsdp x tensor x expert) equals one device's."""

import jax
import numpy as np
import pytest

from jaxpar.config import from_dict
from jaxpar.data import ByteTokenizer
from jaxpar.inference import Engine, SamplingParams
from jaxpar.errors import ConfigError
from jaxpar.models import KVQuantization, caches, kv_cache, kv_cache_latent
from jaxpar.objectives.lm import lm_loss
from jaxpar.train.step import make_gradients
from jaxpar.train.trainer import Trainer
from tests.helpers import synthetic_batch

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Three heads, a q latent of 24, a kv latent of 40, per-head q/k 16 + 8 (rope) and v 20;
# 8 experts in 4 groups, each token's top 3 within its best 2 groups; one dense layer first.
HF_SHAPES = dict(vocab_size=320, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                 num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, n_shared_experts=1,
                 n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
                 routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=40, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=20, max_position_embeddings=128, rms_norm_eps=1e-6,
                 tie_word_embeddings=False,
                 # YaRN past 16 positions, with DeepSeek's softmax mscale (mscale != mscale_all_dim here).
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
                                  "mscale_all_dim": 0.5, "original_max_position_embeddings": 16})


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
  from jaxpar.convert.hf import hf_to_jaxpar
  from tests.test_hf import _random_hf_model
  directory = tmp_path_factory.mktemp("deepseek")
  model = _random_hf_model(transformers.DeepseekV3Config(**HF_SHAPES), directory / "hf")
  torch.manual_seed(1)
  with torch.no_grad():  # a random balancing bias (HF starts it at zero), large enough to re-route
    for layer in model.model.layers[HF_SHAPES["first_k_dense_replace"]:]:
      layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(HF_SHAPES["n_routed_experts"]))
  model.save_pretrained(directory / "hf")
  return model, hf_to_jaxpar(directory / "hf", directory / "jaxpar"), directory


def test_deepseek_v3_imports_with_logits_parity_and_exports(deepseek):
  from tests.test_hf import assert_round_trip
  model, config, directory = deepseek
  m = config.model
  assert (m.family, m.attention_block, m.first_dense_layers, m.mla.kv_lora_rank, m.mla.q_lora_rank) == \
      ("deepseek", "mla", 1, 40, 24)
  assert (m.moe.num_groups, m.moe.groups_per_token, m.moe.shared_mlp_dim, m.moe.router) == (4, 2, 24, "sigmoid")
  assert m.moe.bias_update_rate > 0  # so the model keeps a router bias
  assert (m.rope_scaling.rope_type, m.rope_scaling.mscale_all_dim) == ("yarn", 0.5)
  assert_round_trip(model, config, directory)  # the bias too, bit for bit
  # The bias matters: without it transformers routes differently and its logits move.
  tokens = torch.tensor(np.random.default_rng(0).integers(0, m.vocab_size, (2, 40)))
  biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers[1:]]
  saved = [b.clone() for b in biases]
  with torch.no_grad():
    with_bias = model(tokens).logits
    for b in biases:
      b.zero_()
    without_bias = model(tokens).logits
    for b, s in zip(biases, saved):
      b.copy_(s)
  assert (with_bias - without_bias).abs().max() > 0.1 * with_bias.abs().max()


def test_latent_cache_generates_like_transformers(deepseek):
  model, config, directory = deepseek
  prompt = np.random.default_rng(2).integers(0, 320, 10).tolist()
  with torch.no_grad():
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
  engine = Engine.from_checkpoint(directory / "jaxpar", mesh={"data": 1, "fsdp": 1}, devices=jax.devices()[:1],
                                  tokenizer=ByteTokenizer(), slots=1, page_size=8, prefill_chunks=(8,),
                                  max_seq_len=len(prompt) + 40)
  # The engine's pages hold the latent: one "kv head" of 40 + 8 values per token and layer.
  assert {leaf.shape[1::3] for leaf in jax.tree.leaves(engine.cache)} == {(1, 48)}
  ours = engine.generate([prompt], SamplingParams(max_tokens=40, stop_token_ids=()))[0].tokens
  assert ours == hf[0, len(prompt):].tolist()


def test_latent_cache_bytes_per_token():
  """DeepSeek-V3's real shape: 61 layers x (512 + 64) bf16 values against a GQA cache of
  the same attention width (128 heads x 2 x 128) and Llama 3 8B's (32 layers, 8 x 2 x 128);
  a quantized latent cache is refused in one line."""
  v3 = from_dict({"model": {"family": "deepseek", "attention_block": "mla", "num_layers": 61, "num_heads": 128,
                            "num_kv_heads": 128, "head_dim": 128, "embed_dim": 7168,
                            "mla": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                    "v_head_dim": 128, "q_lora_rank": 1536}}}).model
  llama = from_dict({"model": {"num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}}).model
  latent = kv_cache_latent.bytes_per_token(v3, "bfloat16")
  assert latent == 61 * 576 * 2
  assert kv_cache.bytes_per_token(llama, "bfloat16") == 32 * 2 * 8 * 128 * 2
  assert kv_cache.bytes_per_token(v3, "bfloat16") / latent == pytest.approx(2 * 128 * 128 / 576)
  with pytest.raises(ConfigError, match="kv_cache=int8 with model.attention_block=mla"):
    caches.init(v3, 1, 4, 8, "bfloat16", kv_quantization=KVQuantization("int8", 8, 0))


def test_shipped_v3_has_the_published_context_and_parameter_count():
  """deepseek-v3-671b exports the published config's context and YaRN, and has transformers'
  parameter count for it (built on the meta device; the MTP layer, which transformers skips,
  left out)."""
  from jaxpar.config import load_config
  from jaxpar.convert.hf import hf_config_from_model
  from jaxpar.runtime import abstract_model, count_params
  model = load_config("deepseek-v3-671b").model.model_copy(update={"mtp_depth": 0})
  hf_config = hf_config_from_model(model, "bfloat16")
  assert hf_config["max_position_embeddings"] == 163840
  assert {k: hf_config["rope_scaling"][k] for k in ("rope_type", "factor", "original_max_position_embeddings",
                                                     "beta_fast", "beta_slow", "mscale_all_dim")} == \
      {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
       "beta_slow": 1.0, "mscale_all_dim": 1.0}
  with torch.device("meta"):
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_config))
  assert count_params(abstract_model(model)[1]) == sum(p.numel() for p in hf_model.parameters())
  assert hf_model.model.layers[0].self_attn.scaling == pytest.approx(192 ** -0.5 * (0.1 * np.log(40) + 1) ** 2)


TRAIN_MODEL = {"family": "deepseek", "attention_block": "mla", "vocab_size": 256, "embed_dim": 64,
               "num_layers": 2, "first_dense_layers": 1, "num_heads": 4, "num_kv_heads": 4, "head_dim": 16,
               "mlp_dim": 96, "attention": "chunked",
               "mla": {"q_lora_rank": 32, "kv_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                       "v_head_dim": 12},
               "moe": {"num_experts": 8, "experts_per_token": 2, "expert_mlp_dim": 32, "shared_mlp_dim": 32,
                       "router": "sigmoid", "num_groups": 4, "groups_per_token": 2, "routed_scale": 2.5,
                       "bias_update_rate": 0.01, "balance_loss": 0.01, "router_z_loss": 0.0}}


def _gradients(mesh, devices=None):
  config = from_dict({"model": TRAIN_MODEL, "mesh": {"fsdp": 1, **mesh},
                      "data": {"seq_len": 32, "global_batch_size": 8},
                      "train": {"steps": 1, "log_every": 0}, "checkpoint": {"enabled": False}})
  trainer = Trainer(config, devices)
  params, model_state = trainer.runtime.init()
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in synthetic_batch(config).items()}
  with trainer.context():
    grads, sums, _ = jax.jit(make_gradients(lm_loss(trainer.graphdef, z_loss=0.0), microbatches=1))(params, batch, model_state)
  return jax.device_get((grads, sums))


def test_mla_train_step_on_fsdp_tensor_expert_equals_one_device():
  grads, sums = _gradients({"fsdp": 2, "tensor": 2, "expert": 2})
  want_grads, want_sums = _gradients({}, jax.devices()[:1])
  for key, want in want_sums.items():
    np.testing.assert_allclose(sums[key], want, rtol=1e-5, atol=1e-6, err_msg=key)
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want_grads)}
  assert {"['layers']['attn']['kv_b']", "['layers']['attn']['q_a']",
          "['dense_layers']['attn']['kv_norm']['scale']"} <= names
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
    assert np.abs(w).max() > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * np.abs(w).max(), err_msg=jax.tree_util.keystr(path))


def test_tiny_deepseek_trains_with_multi_token_prediction(tmp_path):
  """tiny-deepseek (MLA, grouped routing, MTP depth 1) on the bundled corpus, one device:
  the loss and the MTP loss both fall, and the MTP loss is what its weight says (0.3 x a
  cross-entropy near ln(vocab) at the start)."""
  from jaxpar.config import load_config
  config = load_config("tiny-deepseek", ["train.steps=25", "train.warmup_steps=5", "train.log_every=0",
                                         "data.global_batch_size=8", "data.seq_len=64", "model.num_layers=2",
                                         "model.scan_unroll=1", "checkpoint.enabled=false",
                                         f"train.run_dir={tmp_path}", "train.peak_flops_per_device=1e12"])
  result = Trainer(config, jax.devices()[:1]).fit(show_progress=False)
  losses, mtp = ([h[key] for h in result.history] for key in ("loss", "loss/mtp"))
  assert 0.3 * 4.0 < mtp[0] < 0.3 * 8.0, mtp[0]
  assert np.mean(losses[-5:]) < losses[0] - 1.5 and np.mean(mtp[-5:]) < mtp[0] - 0.3, (losses, mtp)

