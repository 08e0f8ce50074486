"""LoRA: adapters train over a frozen base (a random Hugging Face Llama, imported), shard like
their projections, save alone, merge, and go to and from Hugging Face PEFT, checked by
loading them with `peft` onto the `transformers` model and comparing f32 logits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import counting_compiles, small_config, synthetic_batch
from jaxpar.checkpoint import Checkpointer
from jaxpar.cli import main
from jaxpar.convert.hf import hf_to_jaxpar, jaxpar_to_hf
from jaxpar.finetune.merge import merge_checkpoint
from jaxpar.objectives import BASE
from jaxpar.finetune.peft import import_peft
from jaxpar.weights import open_run
from jaxpar.train.trainer import Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS = 3
HF_SMALL = dict(vocab_size=320, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
TOKENS = np.random.default_rng(1).integers(0, 320, (2, 24)).astype(np.int32)


def _leaves(tree) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """(HF directory, jaxpar checkpoint of it, its model section) for a random f32 Llama."""
  root = tmp_path_factory.mktemp("base")
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SMALL)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
  model.save_pretrained(root / "hf")
  config = hf_to_jaxpar(root / "hf", root / "jaxpar", tokenizer="byte")
  return root / "hf", root / "jaxpar", config.model.model_dump()


def _train(base, mesh, devices, tmp_path=None, **model_keys):
  _, ckpt, model = base
  lora = {"rank": 4, "alpha": 8.0, "base": str(ckpt)}
  config = small_config(model={**model, "lora": lora, **model_keys}, mesh=mesh, tmp_path=tmp_path,
                        train={"steps": STEPS, "learning_rate": 1e-2})
  trainer = Trainer(config, devices=jax.devices()[:devices])
  state = trainer.init_state()
  before = (_leaves(state.params), _leaves(state.frozen[BASE]))
  batch = synthetic_batch(config)
  result = trainer.fit(state=state, batches=iter([batch] * STEPS), show_progress=False)
  return trainer, before, result


@pytest.fixture(scope="module")
def trained(base, tmp_path_factory):
  return _train(base, {"fsdp": 1}, 1, tmp_path_factory.mktemp("lora"))


def _ours(path, tokens=TOKENS):
  run = open_run(path, mesh={"fsdp": 1}, devices=jax.devices()[:1])
  return np.asarray(run.model(jnp.asarray(tokens))[0])


def _hf_logits(model, tokens=TOKENS):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_only_adapters_train(base, trained):
  trainer, (adapters, base_weights), result = trained
  state = result.state
  assert adapters and all("['lora']" in k for k in _leaves(state.params))
  with Checkpointer(base[1], read_only=True) as ckpt:  # the frozen weights are the base checkpoint's
    assert set(_leaves(ckpt.manager.item_metadata(0)["params"].tree)) == set(base_weights)
  for key, value in _leaves(state.frozen[BASE]).items():
    np.testing.assert_array_equal(value, base_weights[key], err_msg=key)
  changed = [k for k, v in _leaves(state.params).items() if not np.array_equal(v, adapters[k])]
  assert len(changed) == len(adapters)  # every A and B moved (B from zero)
  # The optimizer state mirrors the adapters only: AdamW's two moments of each, nothing more.
  adapter_bytes = sum(v.nbytes for v in adapters.values())
  assert sum(x.nbytes for x in jax.tree.leaves(state.opt_state)) <= 2 * adapter_bytes + 64
  adapter_params = sum(v.size for v in adapters.values())
  assert adapter_params < trainer.num_params / 10
  # What `jaxpar train` reports: 8 bytes per *adapter* parameter (full fine-tuning: 8 per parameter).
  assert trainer.optimizer_bytes_per_param == pytest.approx(8 * adapter_params / trainer.num_params, rel=1e-2)
  assert result.history[-1]["loss"] < result.history[0]["loss"]


def test_adapter_only_checkpoint_merge_and_hf_export(base, trained, tmp_path):
  hf_dir, _, _ = base
  trainer, _, result = trained
  step_dir = result.summary["checkpoint"]
  with Checkpointer(step_dir.rsplit("/", 1)[0], read_only=True) as ckpt:
    assert all("['lora']" in k for k in _leaves(ckpt.manager.item_metadata(STEPS)["params"].tree))
  with trainer.context():
    logits = np.asarray(trainer.runtime.merge(result.state.weights(), result.state.model_state)(TOKENS)[0])
  np.testing.assert_allclose(_ours(step_dir), logits, rtol=1e-5, atol=1e-5)  # the base comes back from lora.base
  base_logits = _hf_logits(transformers.LlamaForCausalLM.from_pretrained(hf_dir))
  assert np.abs(logits - base_logits).max() > 1e-2  # the adapters matter
  # base + adapters = merged weights, and the merged checkpoint exports like any other.
  config, merged = merge_checkpoint(step_dir, tmp_path / "merged", devices=jax.devices()[:1])
  assert config.model.lora is None
  np.testing.assert_allclose(_ours(merged), logits, rtol=1e-5, atol=1e-5)
  exported = jaxpar_to_hf(merged, tmp_path / "hf")
  hf_logits = _hf_logits(transformers.LlamaForCausalLM.from_pretrained(exported))
  np.testing.assert_allclose(hf_logits, logits, rtol=1e-5, atol=1e-5)
  assert main(["convert", "jaxpar-to-hf", step_dir, str(tmp_path / "refused")]) == 2  # merge first


def test_peft_export_loads_in_peft(base, trained, tmp_path):
  hf_dir, _, _ = base
  _, _, result = trained
  out = tmp_path / "peft"
  assert main(["lora", "export-peft", result.summary["checkpoint"], str(out)]) == 0
  saved = json.loads((out / "adapter_config.json").read_text())
  assert (saved["r"], saved["lora_alpha"]) == (4, 8.0)
  model = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(hf_dir), out).eval()
  np.testing.assert_allclose(_hf_logits(model), _ours(result.summary["checkpoint"]), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def peft_adapter(base, tmp_path_factory):
  """(a random PEFT LoRA adapter on the HF base in `peft`, its import as a jaxpar adapter
  checkpoint: (config, step path))."""
  hf_dir, ckpt, _ = base
  root = tmp_path_factory.mktemp("peft")
  torch.manual_seed(1)
  lora = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "o_proj", "down_proj"],
                         init_lora_weights=False)  # B random too: the adapter changes the logits
  model = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf_dir), lora).eval()
  model.save_pretrained(root / "peft")
  return model, import_peft(root / "peft", ckpt, root / "ours", devices=jax.devices()[:1])


def test_peft_import_matches_peft(base, peft_adapter, tmp_path):
  _, ckpt, _ = base
  model, (config, path) = peft_adapter
  assert config.model.lora.targets == ("down", "o", "q") and config.model.lora.scale == 3.0
  np.testing.assert_allclose(_ours(path), _hf_logits(model), rtol=1e-5, atol=1e-5)
  assert main(["lora", "import-peft", str(tmp_path), str(ckpt), str(tmp_path / "x")]) == 2  # not a PEFT dir
  assert main(["lora", "merge", str(ckpt), str(tmp_path / "y")]) == 2  # no adapters to merge


def _greedy_alone(path, prompts, count) -> list[list[int]]:
  """Greedy tokens of one checkpoint (a base, or an adapter over its base) by recomputing the
  whole padded sequence each step: the adapter's own model, no engine."""
  run = open_run(path, mesh={"fsdp": 1}, devices=jax.devices()[:1])
  logits_of = jax.jit(lambda params, tokens: run.runtime.merge(params, run.model_state)(tokens)[0][0])
  out = []
  for prompt in prompts:
    tokens = list(prompt)
    for _ in range(count):
      padded = np.zeros((1, 32), np.int32)
      padded[0, :len(tokens)] = tokens
      tokens.append(int(np.argmax(logits_of(run.params, padded)[len(tokens) - 1])))
    out.append(tokens[len(prompt):])
  return out


def test_adapters_and_base_decode_together(base, trained, peft_adapter):
  """One engine serves the base and two adapters of other ranks, alphas and targets: a batch
  mixing them (the same prompt under each: no cache pages shared across adapters) gives each
  request the greedy tokens of its adapter alone, and a new mix compiles nothing."""
  import openai

  from jaxpar.inference import Engine, SamplingParams
  from tests.serving_setup import RunningServer
  _, ckpt, _ = base
  paths = {None: ckpt, "tuned": trained[2].summary["checkpoint"], "peft": peft_adapter[1][1]}
  run = open_run(ckpt, mesh={"fsdp": 1}, devices=jax.devices()[:1])
  engine = Engine.from_run(run, adapters={k: v for k, v in paths.items() if k}, slots=4, page_size=8, prefill_chunks=(8,),
                      prefill_budget=8, max_seq_len=32)
  asks = [(TOKENS[0, :17], None), (TOKENS[0, :17], "tuned"), (TOKENS[0, :17], "peft"), (TOKENS[1, :20], "peft")]
  alone = {name: iter(_greedy_alone(path, [p for p, n in asks if n == name], 6)) for name, path in paths.items()}
  expected = [next(alone[name]) for _, name in asks]
  assert expected[2] != expected[0]  # the adapters matter

  def served(order):  # each asked request's tokens, in `order`
    requests = [engine.submit(asks[i][0], SamplingParams(max_tokens=6, stop_token_ids=()), adapter=asks[i][1])
                for i in order]
    while engine.has_work:
      engine.step()
    return [r.generated for r in requests]
  assert served([0, 1, 2, 3]) == expected
  with counting_compiles() as compiles:
    for order in ([3, 2, 0, 1], [2, 2, 0]):
      assert served(order) == [expected[i] for i in order]
  assert compiles == []
  # Over HTTP: /v1/models lists the adapters, `model` picks one.
  server = RunningServer(engine, "base")
  try:
    assert [m.id for m in server.client.models.list().data] == ["base", "tuned", "peft"]
    answer = server.client.completions.create(
        model="peft", prompt=asks[3][0].tolist(), max_tokens=6, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert answer.model == "peft"
    assert answer.choices[0].logprobs.tokens == [f"token_id:{t}" for t in expected[3]]
    with pytest.raises(openai.NotFoundError, match="'base', 'tuned', 'peft'"):
      server.client.completions.create(model="nope", prompt="x", max_tokens=1)
  finally:
    server.close()
  assert main(["serve", "--checkpoint", str(ckpt), "--adapter", "tuned"]) == 2  # not NAME=PATH
  assert main(["serve", "--checkpoint", str(ckpt), "--adapter", f"plain={ckpt}"]) == 2  # not an adapter


def test_fsdp_tensor_equals_one_device(base, trained):
  _, _, single = trained
  trainer, _, sharded = _train(base, {"fsdp": 2, "tensor": 2}, 4)
  b_spec = trainer.state_shardings.params["layers"]["attn"]["lora"]["q"]["b"].spec
  assert "tensor" in str(b_spec)  # B [layers, rank, heads, head_dim] splits its heads over tensor
  np.testing.assert_allclose([h["loss"] for h in sharded.history], [h["loss"] for h in single.history],
                             rtol=1e-5)
  for key, value in _leaves(sharded.state.params).items():
    np.testing.assert_allclose(value, _leaves(single.state.params)[key], rtol=1e-4, atol=1e-6, err_msg=key)


def test_qlora_int4_base_trains_and_tracks_the_float_base(base, trained):
  """The same adapters over the int4-quantized base (quantized as it loads): the loss stays
  within 2% of the float32 base's at every step, and falls."""
  _, _, full = trained
  _, (_, base_weights), quantized = _train(base, {"fsdp": 1}, 1, quantization={"mode": "int4", "group_size": 32})
  assert base_weights["['layers']['attn']['q']['values']"].dtype == np.int8  # two int4 values a byte
  losses = [h["loss"] for h in quantized.history]
  np.testing.assert_allclose(losses, [h["loss"] for h in full.history], rtol=0.02)
  assert losses[-1] < losses[0]


def test_expert_adapters_merge_into_the_experts():
  """model.lora.experts: one adapter pair per routed expert (and the attention's), whose
  low-rank updates the merged weights hold: same logits, no adapters left."""
  from jaxpar.finetune.merge import merged_weights
  from jaxpar.runtime import Runtime
  lora = {"rank": 2, "alpha": 4.0, "experts": True, "targets": ["q", "gate", "down"]}
  config = small_config(mesh={"fsdp": 1}, model={"family": "mixtral", "num_layers": 1, "moe": {
      "num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 32}, "lora": lora})
  adapted = Runtime.from_config(config, jax.devices()[:1])
  params, model_state = adapted.init()
  keys = iter(jax.random.split(jax.random.key(3), 64))
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: 0.2 * jax.random.normal(next(keys), x.shape) if "lora" in jax.tree_util.keystr(p) else x, params)
  assert params["layers"]["mlp"]["lora"]["gate"]["b"].shape == (1, 4, 2, 32)  # [layers, experts, rank, mlp]
  plain = Runtime.from_config(small_config(mesh={"fsdp": 1}, model=config.model.model_dump() | {"lora": None}),
                              jax.devices()[:1])
  merged = merged_weights(params, config.model.lora.scale)
  assert jax.tree.structure(merged) == jax.tree.structure(plain.abstract_params)
  def logits(runtime):  # jitted: op by op, a MoE forward takes a minute on CPU
    return jax.jit(lambda p: runtime.merge(p, model_state)(TOKENS[:, :16])[0])
  with adapted.context():
    ours = logits(adapted)(params)
  with plain.context():
    plain_logits = logits(plain)
    folded, base = plain_logits(merged), plain_logits(merged_weights(params, 0.0))
  np.testing.assert_allclose(folded, ours, rtol=1e-4, atol=1e-5)
  assert np.abs(np.asarray(base) - np.asarray(ours)).max() > 1e-3  # the expert adapters matter
