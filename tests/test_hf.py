"""Hugging Face import/export: logits match transformers in f32, export round-trips bit-exact
and loads in transformers; random-weight models from small configs (no download), dense
and mixture-of-experts (Mixtral, Qwen3-MoE: per-expert tensors)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxpar.checkpoint import Checkpointer
from jaxpar.cli import main
from jaxpar.config import replace
from jaxpar.convert.hf import hf_config_from_model, hf_to_jaxpar, jaxpar_to_hf, model_config_from_hf
from jaxpar.runtime import abstract_model
from jaxpar.train.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
FAMILIES = {
  "llama3": lambda: transformers.LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
  "llama2_tied": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True),
  "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=None),
  "qwen2": lambda: transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
  "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=32),  # head_dim != hidden / heads
  "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
  "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=32, num_experts=8,
                                                   num_experts_per_tok=3, moe_intermediate_size=32,
                                                   norm_topk_prob=True),
}


def _random_hf_model(hf_config, directory, **save_kwargs):
  """Every weight random, norms and biases included (HF initialises those to 1 and 0)."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  model.save_pretrained(directory, **save_kwargs)
  return model


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.numpy()


def assert_round_trip(model, config, directory, skip=()):
  """The import in directory/jaxpar gives `model`'s f32 logits within 1e-5 relative; its
  export to directory/back holds the HF tensors bit for bit (less the names in `skip`) and
  transformers reloads it to the same logits. Returns the reloaded model."""
  from safetensors.numpy import load_file
  from jaxpar.convert.hf import jaxpar_to_hf
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (2, 40))
  expected = _hf_logits(model, tokens)
  np.testing.assert_allclose(_our_logits(directory / "jaxpar", config, tokens), expected, rtol=1e-5,
                             atol=1e-5 * np.abs(expected).max())
  jaxpar_to_hf(directory / "jaxpar", directory / "back")
  original, exported = (load_file(directory / d / "model.safetensors") for d in ("hf", "back"))
  assert sorted(exported) == sorted(n for n in original if not any(s in n for s in skip))
  for name, tensor in exported.items():
    np.testing.assert_array_equal(tensor, original[name], err_msg=name)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory / "back").eval()
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens), expected)
  return reloaded


def import_random_hf(hf_config, directory):
  """A random-weight HF model saved in directory/hf, imported into directory/jaxpar: (model, config)."""
  model = _random_hf_model(hf_config, directory / "hf")
  return model, hf_to_jaxpar(directory / "hf", directory / "jaxpar")


def assert_round_trip_near_float64(model, config, directory, layer_types, renamed=()):
  """f32 logits as close to transformers' float64 ones as its own f32 logits are (within 3x,
  or 1e-5 of the largest); the export holds every HF tensor bit for bit (under the name
  with each (part, other) of `renamed` replaced: the export's spelling) and transformers
  reloads it, with `layer_types`, to the same logits."""
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (2, 40))
  # The delta rule's f32 rounding differs between any two orders of the same sums (transformers'
  # own f32 logits are 1-2e-5 from its float64 ones here): both are held to the exact answer.
  with torch.no_grad():
    exact = model.double()(torch.tensor(tokens)).logits.numpy()
  model.float()
  theirs = np.abs(_hf_logits(model, tokens) - exact).max()
  ours = np.abs(_our_logits(directory / "jaxpar", config, tokens) - exact).max()
  # The ratio moves with the host's vector units: qwen3_5_moe was 2.6x on an AMD EPYC host.
  assert ours <= max(3 * theirs, 1e-5 * np.abs(exact).max()), (ours, theirs)
  jaxpar_to_hf(directory / "jaxpar", directory / "back")
  original, exported = (load_file(directory / d / "model.safetensors") for d in ("hf", "back"))
  for part, other in renamed:
    original = {name.replace(part, other) if name.replace(part, other) in exported else name: tensor
                for name, tensor in original.items()}
  assert sorted(exported) == sorted(original)
  for name, tensor in exported.items():
    np.testing.assert_array_equal(tensor, original[name], err_msg=name)
  # The same experts' implementation as `model`: another sums in another order.
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      directory / "back", experts_implementation=model.config._experts_implementation).eval()
  assert reloaded.config.layer_types == layer_types
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens), _hf_logits(model, tokens))


def assert_generates_like_transformers(model, directory, max_tokens=40, page_size=4):
  """The import in directory/jaxpar, through the engine's paged cache (one device, one slot,
  prefill chunks of 8), generates greedily what model.generate does for `max_tokens`
  tokens after a 10-token prompt. Returns the engine."""
  from jaxpar.data import ByteTokenizer
  from jaxpar.inference import Engine, SamplingParams
  prompt = np.random.default_rng(2).integers(0, model.config.vocab_size, 10).tolist()
  with torch.no_grad():
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
  # The imports keep transformers' context (Kimi Linear's is 1M tokens): a page table that wide,
  # and a decode program for each narrower table, took 25 of Kimi's 27 s to compile.
  engine = Engine.from_checkpoint(directory / "jaxpar", mesh={"data": 1, "fsdp": 1}, devices=jax.devices()[:1],
                                  tokenizer=ByteTokenizer(), slots=1, page_size=page_size, prefill_chunks=(8,),
                                  max_seq_len=len(prompt) + max_tokens)
  ours = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, stop_token_ids=()))[0].tokens
  assert ours == hf[0, len(prompt):].tolist()
  return engine


def _our_logits(checkpoint, config, tokens):
  graphdef, *abstract = abstract_model(config.model)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params, model_state = (Checkpointer(checkpoint, read_only=True).restore_item(item, jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), nnx.to_pure_dict(tree)))
      for item, tree in zip(("params", "model_state"), abstract))
  return np.asarray(nnx.merge(graphdef, params, model_state)(jnp.asarray(tokens))[0])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_matches_transformers_and_export_round_trips(family, tmp_path):
  model = _random_hf_model(FAMILIES[family](), tmp_path / "hf")
  config = hf_to_jaxpar(tmp_path / "hf", tmp_path / "jaxpar")  # sharded over 8 devices
  tokens = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 24))
  expected = _hf_logits(model, tokens)
  error = np.abs(_our_logits(tmp_path / "jaxpar", config, tokens) - expected).max()
  assert error < 1e-4 * np.abs(expected).max(), f"{family}: max abs logits error {error}"

  jaxpar_to_hf(tmp_path / "jaxpar", tmp_path / "back")
  original, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
  assert sorted(exported) == sorted(original)
  for name, tensor in original.items():
    assert exported[name].dtype == tensor.dtype and np.array_equal(exported[name], tensor), name
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens), expected)


def test_sharded_safetensors_and_bfloat16_via_cli(tmp_path):
  model = _random_hf_model(FAMILIES["llama3"](), tmp_path / "hf", max_shard_size="100KB")
  assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
  model.to(torch.bfloat16).save_pretrained(tmp_path / "hf16", max_shard_size="100KB")
  assert main(["convert", "hf-to-jaxpar", str(tmp_path / "hf16"), str(tmp_path / "jaxpar")]) == 0
  assert main(["convert", "jaxpar-to-hf", str(tmp_path / "jaxpar" / "0"), str(tmp_path / "back"),
               "--dtype", "bfloat16"]) == 0
  index = json.loads((tmp_path / "hf16" / "model.safetensors.index.json").read_text())["weight_map"]
  original = {}
  for file in set(index.values()):
    original.update(load_file(tmp_path / "hf16" / file))
  exported = load_file(tmp_path / "back" / "model.safetensors")
  # The weights get the mode the export's config.json gets (0644 under umask 022), not the 0600
  # of safetensors' own writer (which transformers' save_pretrained leaves on its shards here).
  back = tmp_path / "back"
  assert (back / "model.safetensors").stat().st_mode & 0o777 == (back / "config.json").stat().st_mode & 0o777
  assert sorted(exported) == sorted(original)
  for name, tensor in original.items():  # bf16 -> f32 in jaxpar -> bf16: lossless
    assert exported[name].dtype == tensor.dtype and np.array_equal(exported[name], tensor), name


def test_imported_checkpoint_fine_tunes(tmp_path):
  model = _random_hf_model(FAMILIES["qwen2"](), tmp_path / "hf")
  imported = hf_to_jaxpar(tmp_path / "hf", tmp_path / "jaxpar")
  config = replace(imported, data={"seq_len": 32, "global_batch_size": 8},
                   train={"steps": 3, "warmup_steps": 1, "log_every": 0, "run_dir": str(tmp_path / "run")})
  # One unpacked batch of random tokens, every step: transformers scores the same rows.
  tokens = np.random.default_rng(0).integers(0, SMALL["vocab_size"], (8, 33)).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((8, 32), np.int32),
           "positions": np.broadcast_to(np.arange(32, dtype=np.int32), (8, 32)), "loss_mask": np.ones((8, 32), np.float32)}
  result = Trainer(config).fit(batches=iter([batch] * 3), restore=tmp_path / "jaxpar", show_progress=False)
  assert [h["step"] for h in result.history] == [1, 2, 3]  # params from HF, a fresh optimizer
  with torch.no_grad():
    logits = model(torch.tensor(batch["inputs"], dtype=torch.long)).logits.double()
  want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           torch.tensor(batch["targets"], dtype=torch.long).reshape(-1))
  assert result.history[0]["loss"] == pytest.approx(float(want), rel=1e-4)  # the first step scores the HF weights
  assert result.history[2]["loss"] < result.history[0]["loss"]  # step 1 warms up from a zero rate


def test_moe_configs_map_both_ways_and_unmappable_ones_are_clear_errors():
  qwen = model_config_from_hf(FAMILIES["qwen3_moe"]().to_dict())
  assert (qwen.family, qwen.qk_norm, qwen.moe.num_experts, qwen.moe.experts_per_token,
          qwen.moe.expert_mlp_dim, qwen.moe.normalize_weights) == ("qwen3_moe", True, 8, 3, 32, True)
  mixtral = model_config_from_hf(FAMILIES["mixtral"]().to_dict())
  assert (mixtral.family, mixtral.moe.num_experts, mixtral.moe.expert_mlp_dim) == ("mixtral", 4, 96)
  with pytest.raises(ValueError, match="decoder_sparse_step=2, .* not supported"):
    model_config_from_hf({**FAMILIES["qwen3_moe"]().to_dict(), "decoder_sparse_step": 2})
  deepseek_style = mixtral.model_copy(update={"moe": mixtral.moe.model_copy(update={"router": "sigmoid"})})
  with pytest.raises(ValueError, match="model.moe.router='sigmoid' has no Hugging Face mixtral"):
    hf_config_from_model(deepseek_style, "float32")


def test_unknown_architectures_are_clear_errors():
  with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
    model_config_from_hf({"model_type": "gpt2"})
  with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
    model_config_from_hf({"model_type": "llama", **{k: 8 for k in SMALL}, "rms_norm_eps": 1e-6,
                          "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
