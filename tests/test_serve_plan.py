"""`jaxpar plan --serve`: the candidates' bytes against the arrays they lay out, the ranking
and its compiled check for a TPU slice, the verdict for a model no layout holds, and the
written serve command."""

import math

import pytest
import yaml

from jaxpar.aot.serve_plan import (ServeCandidate, Workload, active_parameters, candidates, hands_over_pages,
                                   meshes, plan_serving)
from jaxpar.cli import main
from jaxpar.config import load_config

pytestmark = pytest.mark.tpu


def test_meshes_split_the_chips_into_replicas_and_one_engines_axes():
  dense, moe = load_config("tiny"), load_config("tiny-moe")
  for config in (dense, moe):
    for replicas, mesh in meshes(config, 8):
      assert replicas * math.prod(mesh.values()) == 8
  assert {m["expert"] for _, m in meshes(dense, 8)} == {1}
  assert (1, {"data": 1, "expert": 8, "tensor": 1}) in list(meshes(moe, 8))
  assert (8, {"data": 1, "expert": 1, "tensor": 1}) in list(meshes(dense, 8))


def test_candidates_bytes_follow_their_layouts_and_rank_by_the_estimate():
  config = load_config("tiny", ["model.max_seq_len=4096"])
  kept, full, _ = candidates(config, "v5e-4", context=4096, max_slots=64, page_size=128)
  assert kept and not full
  by = {(c.replicas, c.mesh["tensor"], c.kv_cache): c for c in kept}
  one, split = by[(4, 1, "bfloat16")], by[(1, 4, "bfloat16")]
  # Tensor parallelism over 4 chips: the projections in quarters (embeddings and norms stay whole).
  assert split.weights_bytes < one.weights_bytes / 2
  # int8 keys and values take about half the bytes of bfloat16 (plus their scales).
  assert 0.45 < by[(4, 1, "int8")].kv_bytes_per_token / one.kv_bytes_per_token < 0.6
  assert all(c.slots == min(c.tokens_per_chip // 4096, 64) for c in kept)
  rates = [c.decode_tokens_s for c in kept]
  assert rates == sorted(rates, reverse=True)
  # Memory-bound decode of a tiny model: replicas (no collectives) estimate ahead of one tensor-parallel engine.
  assert one.decode_tokens_s > split.decode_tokens_s


def test_active_parameters_count_the_routed_experts_a_token_uses():
  import jax

  from jaxpar.runtime import abstract_model
  config = load_config("tiny-moe")
  params = abstract_model(config.model)[1]
  total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  moe = config.model.moe
  layers = params["layers"]["mlp"]
  routed = sum(math.prod(layers[k].shape) for k in ("gate", "up", "down"))
  assert active_parameters(config, params) == pytest.approx(total - routed * (1 - moe.experts_per_token / moe.num_experts))


def test_plan_serve_compiles_the_best_and_writes_the_command(tmp_path, capsys):
  output = tmp_path / "serve.yaml"
  assert main(["plan", "--serve", "tiny", "model.max_seq_len=2048", "--topology", "v6e-4", "--context", "2048",
               "--max-slots", "16", "--top", "2", "--output", str(output)]) == 0
  out = capsys.readouterr().out
  written = yaml.safe_load(output.read_text())
  assert written["command"].startswith("jaxpar serve RUN ") and f"--slots {written['slots']}" in written["command"]
  assert written["topology"] == "v6e-4" and written["estimate"]["decode_tokens_s"] > 0
  assert "estimates, not measurements" in out and "fits" in out


def test_a_model_too_big_for_the_slice_names_the_smallest_that_holds_it():
  config = load_config("llama3-70b")
  with pytest.raises(Exception, match=r"does not fit v6e-1 .* the smallest v6e slice that holds it is v6e-8, or "
                     r"quantize its weights"):
    plan_serving(config, "v6e-1", context=8192, top=1)


def test_plan_serve_needs_a_topology(capsys):
  assert main(["plan", "--serve", "tiny"]) == 2
  assert "add --topology" in capsys.readouterr().err


def test_the_serve_command_names_every_choice():
  candidate = ServeCandidate(2, {"data": 1, "expert": 1, "tensor": 4}, "int8", slots=48)
  assert candidate.command("runs/big") == "jaxpar serve runs/big mesh.tensor=4 mesh.fsdp=1 --replicas 2 --slots 48 " \
                                          "--kv-cache int8"


def test_a_workload_adds_disaggregated_candidates_and_ranks_by_what_they_serve():
  """Long prompts, short completions: co-located, each replica's ITL is its decode step plus
  its prefills' share (slots / O x prefill); disaggregated, the decode step alone, and the
  slice serves the lesser of decode's and prefill's rates. With an ITL bound that only
  disaggregation keeps, its candidates rank first; without a workload there are none."""
  config = load_config("tiny", ["model.max_seq_len=4096"])
  plain, _, _ = candidates(config, "v5e-4", context=4096, max_slots=64, page_size=128)
  assert not any(c.prefill_devices for c in plain)
  loose = Workload(prompt_tokens=3072, output_tokens=16)
  kept, _, _ = candidates(config, "v5e-4", context=4096, max_slots=64, page_size=128, workload=loose)
  split = [c for c in kept if c.prefill_devices]
  assert split and all(c.prefill_devices == 2 and c.replicas == 1 for c in split)
  for c in kept:
    decode_s = c.replicas * c.slots / c.decode_tokens_s
    if c.prefill_devices:
      assert c.itl_s == decode_s
      assert c.served_tokens_s == min(c.slots / decode_s, 16 / c.prefill_s)
    else:
      assert math.isclose(c.itl_s, decode_s + c.slots / 16 * c.prefill_s)
      assert math.isclose(c.served_tokens_s, c.replicas * c.slots / c.itl_s)
  assert [c.served_tokens_s for c in kept] == sorted((c.served_tokens_s for c in kept), reverse=True)
  bound = min(c.itl_s for c in split) * 1.01
  assert all(c.itl_s > bound for c in kept if not c.prefill_devices)  # prefills push every co-located ITL past it
  tight = Workload(prompt_tokens=3072, output_tokens=16, itl_slo_s=bound)
  ranked, _, _ = candidates(config, "v5e-4", context=4096, max_slots=64, page_size=128, workload=tight)
  assert ranked[0].prefill_devices == 2
  assert f"--prefill-devices 2 --slots {ranked[0].slots}" in ranked[0].command("r")


def test_models_whose_caches_are_not_all_pages_get_no_disaggregated_candidates():
  """Local layers' window rings (Gemma 3) and linear attention's states (Qwen3.5) stay where
  they were written: the engine refuses to disaggregate them, so the planner offers no split."""
  assert hands_over_pages(load_config("tiny").model) and hands_over_pages(load_config("tiny-deepseek").model)
  assert not hands_over_pages(load_config("tiny-gemma3").model)
  assert not hands_over_pages(load_config("tiny-qwen3.5").model)


def test_plan_serve_with_a_workload_compiles_and_writes_its_rates(tmp_path, capsys):
  output = tmp_path / "serve.yaml"
  assert main(["plan", "--serve", "tiny", "model.max_seq_len=2048", "--topology", "v6e-4", "--context", "2048",
               "--max-slots", "16", "--top", "2", "--output-tokens", "64", "--output", str(output)]) == 0
  written = yaml.safe_load(output.read_text())
  assert written["workload"] == {"prompt_tokens": 1024, "output_tokens": 64, "itl_slo_s": None}
  assert written["estimate"]["served_tokens_s"] > 0 and written["estimate"]["itl_s"] > 0
  assert "1024-token prompts, 64-token completions" in capsys.readouterr().out
  assert main(["plan", "--serve", "tiny", "--topology", "v6e-4", "--itl-slo", "50"]) == 2
  assert "add --output-tokens" in capsys.readouterr().err
