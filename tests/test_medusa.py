"""Medusa draft heads: trained over a frozen base (`train.objective: medusa`) they learn to guess
tokens further ahead than the model does, the base stays bitwise as it was, and as the engine's
draft source they give exactly plain greedy decoding's tokens in fewer target passes, from
Python and from `jaxpar generate`. Heads over another base, or asked for more proposals than
they have, are refused in one line."""

import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.config import MeshConfig, ModelConfig
from jaxpar.data import ByteTokenizer
from jaxpar.data.heldout import token_windows, window_batch
from jaxpar.data.sources import read_documents
from jaxpar.errors import ConfigError
from jaxpar.inference import Engine, SamplingParams
from jaxpar.inference.medusa import MedusaDraft, with_heads
from jaxpar.models.medusa import fingerprint, same_fingerprint
from jaxpar.objectives import BASE
from jaxpar.objectives.medusa import ahead, head_accuracy, medusa_loss, rank_accuracy
from jaxpar.runtime import Runtime
from jaxpar.train.trainer import Trainer
from jaxpar.weights import open_run, split_weights
from tests.helpers import SMALL_MODEL, small_config, synthetic_batch

HEADS = 3
STEPS = 150
TRAIN = {"steps": STEPS, "learning_rate": 3e-3, "warmup_steps": 5}
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy", "She was"]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=())
ENGINE = dict(slots=4, max_seq_len=128, prefill_chunks=(32,))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(base run, heads run): the small model trained on the bundled corpus, then 3 heads over it."""
  root = tmp_path_factory.mktemp("medusa")
  one = jax.devices()[:1]
  Trainer(small_config(tmp_path=root / "base", train=TRAIN), devices=one).fit(show_progress=False)
  heads = small_config(tmp_path=root / "heads", model={"medusa": {"heads": HEADS, "base": str(root / "base/run")}},
                       train={**TRAIN, "objective": "medusa"})
  Trainer(heads, devices=one).fit(show_progress=False)
  return root / "base/run", root / "heads/run"


@pytest.fixture(scope="module")
def plain(runs):
  return [r.tokens for r in Engine.from_checkpoint(runs[0], **ENGINE).generate(PROMPTS, GREEDY)]


def _heldout(windows=16, seq_len=64):
  text = "\n\n".join(read_documents("bundled-heldout"))
  return window_batch(token_windows(text, ByteTokenizer(), seq_len, windows))


def test_ahead_shifts_targets_within_each_document():
  batch = {"targets": np.array([[1, 2, 3, 4, 5]]), "loss_mask": np.ones((1, 5)),
           "segment_ids": np.array([[1, 1, 1, 2, 2]])}
  targets, mask = ahead(batch, 1)
  assert targets[0, :4].tolist() == [2, 3, 4, 5]
  # Position 2's token two ahead is in the next document; the last runs past the row.
  assert mask[0].tolist() == [True, True, False, True, False]


def test_heads_train_over_a_bitwise_frozen_base(runs):
  base_run, heads_run = (open_run(p, mesh={"fsdp": 1}, devices=jax.devices()[:1]) for p in runs)
  heads, base = split_weights(heads_run.runtime, heads_run.params)
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(base_run.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b))
  assert all(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(heads))  # every head weight moved
  stamp = heads_run.model_state["medusa"]["base_fingerprint"]
  assert same_fingerprint(stamp, fingerprint(base_run.params))
  assert not same_fingerprint(stamp, fingerprint(jax.tree.map(lambda x: x * 1.001, base_run.params)))


def test_trained_heads_guess_further_ahead_than_fresh_ones(runs):
  """Held-out text: each trained head beats the same head at its start (the model's own
  next-token guess, repeated), by a margin of at least 5 points (the printed numbers)."""
  run = open_run(runs[1], mesh={"fsdp": 1}, devices=jax.devices()[:1])
  batch = jax.tree.map(jnp.asarray, _heldout())
  trained = head_accuracy(run.model, batch)
  fresh_params = {**run.params, "medusa": jax.tree.map(jnp.zeros_like, run.params["medusa"])}
  fresh = head_accuracy(run.runtime.merge(fresh_params, run.model_state), batch)
  print("held-out top-1 per head: trained", [f"{a:.3f}" for a in trained], "fresh", [f"{a:.3f}" for a in fresh])
  assert all(t > f + 0.05 for t, f in zip(trained, fresh)), (trained, fresh)
  assert trained[0] > trained[-1]  # a guess further ahead is harder
  by_rank = np.asarray(rank_accuracy(run.model, batch, 4))
  np.testing.assert_allclose(by_rank[:, 0], trained, atol=1e-6)  # rank 0 is the head's best guess
  assert (by_rank[:, 1:].sum(axis=1) > 0.05).all()  # lower ranks hold more of the right tokens


def test_medusa_greedy_equals_plain_in_fewer_passes(runs, plain):
  engine = Engine.from_checkpoint(runs[1], **ENGINE, speculative=MedusaDraft())
  mixed = [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(), speculative=on)
           for on in (True, False, True)]
  done = engine.generate(PROMPTS, mixed)
  assert [r.tokens for r in done] == plain
  assert done[1].draft_proposed == 0 and done[0].draft_accepted > 0 and done[2].draft_accepted > 0
  # The speculating rows took fewer passes than their tokens (each kept proposal saves one, less
  # where a row's last round kept more than it needed); the other row one per token.
  kept = done[0].draft_accepted + done[2].draft_accepted
  assert 3 * 40 - kept <= engine.stats["speculative_rounds"] < 3 * 40 - kept + 2 * HEADS
  assert engine.pool.free == engine.pool.num_pages


def test_a_tree_keeps_more_per_pass_with_the_same_tokens(runs, plain):
  """A 12-node tree of the heads' top guesses against their chain: the same greedy tokens in
  fewer target passes."""
  passes = {}
  for name, draft in (("chain", MedusaDraft()), ("tree", MedusaDraft(tree=12))):
    engine = Engine.from_checkpoint(runs[1], **ENGINE, speculative=draft)
    assert [r.tokens for r in engine.generate(PROMPTS, GREEDY)] == plain, name
    passes[name] = engine.stats["speculative_rounds"]
    assert engine.pool.free == engine.pool.num_pages
  assert passes["tree"] < passes["chain"], passes


@pytest.mark.parametrize("kv_cache", [None, "int8"])
def test_medusa_with_shared_prefixes(runs, kv_cache):
  """Requests that share a prompt (prefix caching) get plain decoding's tokens, over a float
  and a quantized cache; a tree over a quantized cache is refused (its candidates fill slots
  past the row's page, quantized before the check keeps them)."""
  prompts = [PROMPTS[0] + " she said", PROMPTS[0] + " he said", PROMPTS[0] + " they said"]
  want = [r.tokens for r in Engine.from_checkpoint(runs[0], **ENGINE, kv_cache=kv_cache).generate(prompts, GREEDY)]
  engine = Engine.from_checkpoint(runs[1], **ENGINE, kv_cache=kv_cache, speculative=MedusaDraft())
  assert [r.tokens for r in engine.generate(prompts, GREEDY)] == want
  assert engine.stats["prefix_cache_hits"] > 0 and engine.stats["speculative_accepted"] > 0
  if kv_cache:
    with pytest.raises(ConfigError, match="give k \\(a chain\\), or serve with --kv-cache float"):
      Engine.from_checkpoint(runs[1], **ENGINE, kv_cache=kv_cache, speculative=MedusaDraft(tree=8))


def test_heads_attach_to_their_base_and_refuse_another(runs, plain, tmp_path):
  base, heads = runs
  with open_run(base, mesh={"fsdp": 1}, devices=jax.devices()[:1]) as run:
    runtime, params, model_state = with_heads(run, heads)
    engine = Engine(runtime, params, run.tokenizer, model_state=model_state, **ENGINE,
                    speculative=MedusaDraft(k=2))
    assert [r.tokens for r in engine.generate(PROMPTS, GREEDY)] == plain
    with pytest.raises(ConfigError, match="model has 3 draft heads"):
      Engine(runtime, params, run.tokenizer, model_state=model_state, **ENGINE, speculative=MedusaDraft(k=4))
    other = jax.tree.map(lambda x: x * 1.01, params)
    with pytest.raises(ConfigError, match="trained over another base"):
      Engine(runtime, other, run.tokenizer, model_state=model_state, **ENGINE, speculative=MedusaDraft())
    with pytest.raises(ConfigError, match="has no draft heads"):
      Engine.from_run(run, **ENGINE, speculative=MedusaDraft())


def test_generate_attaches_heads_from_the_command_line(runs, plain, capsys):
  base, heads = runs
  main(["generate", str(base), "--prompt", PROMPTS[1], "--max-tokens", "40", "--temperature", "0",
        "--speculative", f"medusa={heads},tree=6", "--slots", "1", "--max-seq-len", "128"])
  printed = capsys.readouterr().out
  assert ByteTokenizer().decode(plain[1]) in printed


def test_medusa_settings_are_checked_before_anything_compiles(runs, capsys):
  with pytest.raises(ConfigError, match="only train.objective=medusa trains"):
    Trainer(small_config(model={"medusa": {"heads": 2}}), devices=jax.devices()[:1])
  with pytest.raises(ConfigError, match="add `medusa:"):
    Trainer(small_config(train={"objective": "medusa"}), devices=jax.devices()[:1])
  assert main(["generate", str(runs[0]), "--prompt", "x", "--speculative", "medusa,n=3"]) == 2
  assert "medusa[=HEADS_RUN][,k=K | ,tree=NODES]" in capsys.readouterr().err


def test_heads_export_in_the_medusa_projects_layout(runs, tmp_path):
  """`jaxpar convert medusa-heads`: the file's tensors, applied as the Medusa project applies
  them (x + SiLU(linear(x)), then the head's linear to the vocabulary), give our heads' logits."""
  from safetensors.numpy import load_file
  assert main(["convert", "medusa-heads", str(runs[1]), str(tmp_path / "heads")]) == 0
  assert main(["convert", "jaxpar-to-hf", str(runs[1]), str(tmp_path / "hf")]) == 2  # the heads are no HF model
  tensors = load_file(tmp_path / "heads/medusa_lm_head.safetensors")
  config = json.loads((tmp_path / "heads/config.json").read_text())
  assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (HEADS, 1)
  run = open_run(runs[1], mesh={"fsdp": 1}, devices=jax.devices()[:1])
  hidden = np.random.default_rng(0).normal(size=(3, run.config.model.embed_dim)).astype(np.float32)
  ours = np.asarray(run.model.medusa.logits(jnp.asarray(hidden), run.model.output_projection()))
  for head in range(HEADS):
    x = hidden + jax.nn.silu(hidden @ tensors[f"{head}.0.linear.weight"].T + tensors[f"{head}.0.linear.bias"])
    np.testing.assert_allclose(np.asarray(x) @ tensors[f"{head}.1.weight"].T, ours[:, head], rtol=1e-4, atol=1e-4)


def test_the_openai_client_gets_the_same_text_with_medusa_on_or_off(runs, plain):
  """A server over the heads' run (a tree): the `openai` client's greedy text is plain
  decoding's whether the request takes the drafts or not; usage reports what they did."""
  openai = pytest.importorskip("openai")
  uvicorn = pytest.importorskip("uvicorn")
  from jaxpar.inference.server import build_app
  engine = Engine.from_checkpoint(runs[1], **ENGINE, speculative=MedusaDraft(tree=6))
  instance = uvicorn.Server(uvicorn.Config(build_app(engine, model_name="heads"), host="127.0.0.1", port=0,
                                           log_level="warning"))
  thread = threading.Thread(target=instance.run, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + 60
    while not instance.started:
      assert time.monotonic() < deadline, "the server did not start"
      time.sleep(0.05)
    port = instance.servers[0].sockets[0].getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    on, off = (client.completions.create(model="heads", prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                         extra_body={"speculative": flag}) for flag in (True, False))
    assert on.choices[0].text == off.choices[0].text == ByteTokenizer().decode(plain[1])
    used = on.usage.model_extra["speculative"]
    assert used["accepted_tokens"] > 0 and used["target_passes"] < on.usage.completion_tokens
    assert off.usage.model_extra["speculative"]["proposed_tokens"] == 0
  finally:
    instance.should_exit = True
    thread.join(timeout=30)


@pytest.mark.parametrize("source", ["medusa", "medusa tree", "ngram"])
def test_drafts_under_a_grammar_give_the_constrained_tokens(runs, source):
  """Rows under a regex or a JSON schema, beside a free row: each gets the tokens plain
  constrained decoding gives it (drafts cut at the first token the grammar forbids, each
  position's logits masked; a tree's rows under a grammar take no drafts)."""
  pytest.importorskip("llguidance")
  from jaxpar.inference import grammar
  from jaxpar.inference.speculative import NgramDraft
  plain = Engine.from_checkpoint(runs[0], **ENGINE)
  vocab = plain.runtime.model_config.vocab_size
  rules = [grammar.constraint("regex", r"[a-z ]{12,40}\.", "test", plain.tokenizer, vocab),
           grammar.constraint("json", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}},
                                       "required": ["name"], "additionalProperties": False},
                              "test", plain.tokenizer, vocab), None]
  settings = [SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(), constraint=rule) for rule in rules]
  prompts = [PROMPTS[0], "Mr. Darcy said: ", PROMPTS[2]]
  want = [r.tokens for r in plain.generate(prompts, settings)]
  draft = {"medusa": MedusaDraft(), "medusa tree": MedusaDraft(tree=6), "ngram": NgramDraft(k=3)}[source]
  engine = Engine.from_checkpoint(runs[1 if source.startswith("medusa") else 0], **ENGINE, speculative=draft)
  done = engine.generate(prompts, settings)
  assert [r.tokens for r in done] == want
  json.loads(ByteTokenizer().decode(want[1]))  # the schema's output parses
  if source != "ngram":
    assert done[0].draft_accepted > 0 or source == "medusa tree"  # drafts kept under the regex
    assert done[2].draft_accepted > 0


def test_the_fused_and_plain_head_losses_agree():
  """train.logits_chunk_len > 0 (the fused loss, never all logits at once) and 0 (plain
  logits): the same loss and per-head sums, and the same gradients for the heads."""
  config = small_config(model={"medusa": {"heads": 2}}, train={"objective": "medusa"})
  runtime = Runtime(ModelConfig(**{**SMALL_MODEL, "medusa": {"heads": 2}}), MeshConfig(fsdp=1), jax.devices()[:1])
  params, model_state = runtime.init()
  heads, base = split_weights(runtime, params)
  heads = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(1), x.shape), heads)
  batch = jax.tree.map(jnp.asarray, synthetic_batch(config))
  results = [jax.jit(jax.value_and_grad(medusa_loss(runtime.graphdef, 2, 0.8, chunk), has_aux=True))(
      heads, model_state, batch, {BASE: base}) for chunk in (0, 8)]
  (plain_loss, (plain_sums, _)), plain_grads = results[0]
  (fused_loss, (fused_sums, _)), fused_grads = results[1]
  np.testing.assert_allclose(fused_loss, plain_loss, rtol=1e-5)
  for key in ("metric/head0_loss", "metric/head1_loss", "tokens"):
    np.testing.assert_allclose(fused_sums[key], plain_sums[key], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(plain_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
