"""`jaxpar compile`: TPU topology compiles on this CPU host (libtpu) report memory that
matches hand computation, say DOES NOT FIT for weights that cannot fit, count collectives
per loop trip, and see the DCN collectives of a multi-slice mesh."""

import importlib.util
import json
import re

import jax
import pytest

from jaxpar.aot import hlo
from jaxpar.aot.chips import parse_slice, topology_devices
from jaxpar.aot.compile import abstract_batch, build_report, compile_for_topology, compile_step
from jaxpar.aot.compile import per_device_bytes
from jaxpar.aot.report import count, format_report, gib, seconds, traffic_line
from jaxpar.cli import main
from jaxpar.config import load_config
from jaxpar.train.trainer import Trainer
from tests.helpers import small_config



@pytest.mark.parametrize("name,libtpu_name", [
    ("v6e-256", "v6e:16x16"), ("v5p-128", "v5p:4x4x4"), ("v5p-512", "v5p:4x8x8"),
    ("v5e-256", "v5e:16x16"), ("v5e-4", "v5e:2x2"), ("v5p:2x2x1", "v5p:2x2x1")])
def test_slice_names(name, libtpu_name):
  assert parse_slice(name)[1] == libtpu_name


def test_bad_slice_names_say_what_exists():
  with pytest.raises(ValueError, match="no v5p slice of that size; use one of v5p-8"):
    parse_slice("v5p-100")
  with pytest.raises(ValueError, match="is not like v6e-256"):
    parse_slice("h100-8")


FSDP_MODEL = dict(vocab_size=1024, embed_dim=256, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=128, mlp_dim=512, compute_dtype="bfloat16")


@pytest.mark.tpu
def test_fsdp_argument_bytes_match_hand_computation():
  config = small_config(model=FSDP_MODEL, mesh={"fsdp": 4}, data={"seq_len": 128})
  chip, devices = topology_devices("v5e-4")
  trainer = Trainer(config, devices)
  compiled, oom = compile_step(trainer)
  assert oom is None
  m = config.model
  sharded = 2 * m.vocab_size * m.embed_dim + m.num_layers * (
      2 * m.embed_dim * m.num_heads * m.head_dim + 2 * m.embed_dim * m.num_kv_heads * m.head_dim
      + 3 * m.embed_dim * m.mlp_dim)
  replicated = (2 * m.num_layers + 1) * m.embed_dim  # norm scales
  params = 4 * (sharded // 4 + replicated)  # f32, split 4 ways over fsdp
  state = trainer.abstract_state()
  assert per_device_bytes(state.params) == params
  assert per_device_bytes(state.opt_state) == 2 * params + 2 * 4  # Adam mu, nu + counts
  batch = 5 * 4 * config.data.global_batch_size // 4 * config.data.seq_len
  assert per_device_bytes(abstract_batch(trainer)) == batch
  expected = 3 * params + 3 * 4 + batch
  # The TPU pads each of the 3 int32 scalars (step, Adam count, schedule count) to 512 bytes.
  assert compiled.memory_analysis().argument_size_in_bytes == expected + 3 * (512 - 4)
  report = build_report(trainer, compiled, None, chip, "v5e-4", 1)
  assert report["fits"] and report["memory"]["total"] < chip.hbm_bytes
  # FSDP gathers the weights in the compute dtype (bf16), never the f32 master copy.
  gathered = {c.dtype for c in hlo.collectives(compiled.as_text(), [0] * 4) if c.kind == "all-gather"}
  assert "bf16" in gathered and "f32" not in gathered


OFFLOADED = ("decoder_layer_input", "qkv_proj", "out_proj")


@pytest.mark.tpu
@pytest.mark.pod_fit
def test_offloaded_activations_live_in_host_memory_not_hbm():
  # Eight scanned layers (compile time is flat in depth): at one layer the host-transfer
  # staging buffers outweigh the one layer's activations they move out of HBM.
  layers, seq = 8, 4096
  def compile_with(action):
    model = {**FSDP_MODEL, "num_layers": layers, "max_seq_len": seq,
             "remat": {name: action for name in OFFLOADED}}
    return compile_for_topology(small_config(model=model, mesh={"fsdp": 4}, data={"seq_len": seq}),
                                "v5e-4")[0]
  offloaded, saved = compile_with("offload"), compile_with("save")
  m = FSDP_MODEL
  per_token = m["embed_dim"] + (m["num_heads"] + 2 * m["num_kv_heads"]) * m["head_dim"] + m["embed_dim"]
  tokens = 8 // 4 * seq  # per device
  named = layers * tokens * per_token * 2  # bf16: what the three names hold over all layers
  assert offloaded["memory"]["host_total"] == pytest.approx(named, rel=0.05)
  assert saved["memory"]["host_total"] == 0
  assert offloaded["memory"]["total"] < saved["memory"]["total"] - named / 2
  assert offloaded["estimate"]["host_transfer_bytes"] >= 2 * named * 0.95  # out, and back in


@pytest.mark.tpu
def test_weights_that_cannot_fit_are_reported_as_not_fitting():
  # 1.1B f32 params replicated (plain DP): 13 GiB of params + Adam, plus grads > 16 GiB.
  model = dict(vocab_size=131072, embed_dim=4096, num_layers=1, num_heads=32, num_kv_heads=8,
               head_dim=128, mlp_dim=256, compute_dtype="bfloat16")
  config = small_config(model=model, mesh={"data": 4, "fsdp": 1, "rules": "dp"},
                        data={"seq_len": 128, "global_batch_size": 4})
  report, compiled = compile_for_topology(config, "v5e-4")
  assert not report["fits"]
  # Either the compiler runs out of memory, or it compiles a program larger than the chip.
  if compiled is None:
    assert "memory" in report["oom"].lower()
  else:
    assert report["memory"]["total"] > report["hbm_bytes"]
  text = format_report({**report, "compile_s": 0})
  assert "DOES NOT FIT" in text
  knobs = text.split("to fit: ")[1]  # the knobs that would shrink it, named as config keys
  assert "model.remat=full" in knobs and "mesh.fsdp, now 1" in knobs and "train.microbatches=2" in knobs
  assert "jaxpar plan CONFIG --topology v5e-4" in knobs


def _compile_tiny(layers, topology="v6e-4", num_slices=1, **mesh):
  overrides = [f"model.num_layers={layers}", "model.scan_unroll=1", "data.global_batch_size=8"]
  overrides += [f"mesh.{k}={v}" for k, v in mesh.items()]
  return compile_for_topology(load_config("tiny", overrides), topology, num_slices)[0]


@pytest.mark.tpu
def test_collectives_are_counted_per_loop_trip():
  # Scanned layers compile to one loop body whatever the depth: 8 more layers must add
  # 8 x (one layer's gathers), which only trip-count weighting sees.
  shallow, deep = (_compile_tiny(n) for n in (2, 10))
  count = lambda r: sum(c["count"] for c in r["collectives"] if c["kind"] == "all-gather")  # noqa: E731
  per_layer = (count(deep) - count(shallow)) / 8
  assert per_layer >= 7  # q, k, v, o, gate, up, down are each gathered at least once
  assert count(deep) == count(shallow) + 8 * per_layer
  assert deep["estimate"]["ici_s"] > shallow["estimate"]["ici_s"]


@pytest.mark.tpu
def test_multi_slice_reports_dcn_collectives():
  report = _compile_tiny(2, "v5e-4", 2, data=2)
  assert report["devices"] == 8 and report["dcn_axis"] == "data"
  kinds = {(c["kind"], c["dcn"]) for c in report["collectives"]}
  assert ("all-reduce", True) in kinds  # gradients summed across slices
  assert ("all-gather", False) in kinds  # FSDP inside each slice


@pytest.mark.tpu
def test_stage_over_dcn_sends_only_hand_offs_and_the_stage_split_weights_across_slices():
  report = _compile_tiny(4, "v5e-4", 2, stage=2, dcn_axis="stage")
  assert report["dcn_axis"] == "stage" and report["mesh"] == {"stage": 2, "fsdp": 4}
  dcn, minimum = report["dcn"], report["dcn"]["minimum"]
  # 2 x (M=2 + S-1 = 3 iterations) hand-offs of one row x 128 positions x 128 f32 per device.
  assert minimum["stage hand-offs"] == 2 * 3 * 128 * 128 * 4
  # One layer's weights (~850 KiB) gathered across slices would be more than all the slack:
  # what crosses is the hand-offs, the outputs' all-reduce and the embedding's FSDP share.
  assert minimum["total"] <= dcn["wire_bytes"] <= 1.25 * minimum["total"]
  assert "across slices (DCN, 'stage' spanning them)" in format_report({**report, "compile_s": 0})


def test_hlo_parser_on_a_handwritten_module():
  text = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[8]{0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %ag)
}

%all-reduce-scatter.1 (x: f32[16]) -> f32[8] {
  %r = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups={{0,1},{2,3},{4,5},{6,7}}
  ROOT %s = f32[8]{0} dynamic-slice(%r, %o), dynamic_slice_sizes={8}
}

%fused (y: f32[4]) -> f32[8] {
  ROOT %g = f32[8]{0} all-gather(%y), channel_id=4, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  %ar = f32[8]{0} all-reduce(%a), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}
  %rs = f32[8]{0} fusion(%b), kind=kCustom, calls=%all-reduce-scatter.1
  %fg = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused
}
"""
  slices = [0, 0, 0, 0, 1, 1, 1, 1]
  rows = {(r["kind"], r["dcn"]): r for r in hlo.summarize(hlo.collectives(text, slices))}
  gather = rows[("all-gather", False)]
  assert gather["count"] == 5 + 1 and gather["bytes"] == 5 * 32 + 32  # the fused one too
  assert gather["wire_bytes"] == pytest.approx(5 * 32 * 3 / 4 + 32 / 2)
  # The all-reduce inside TPU's all-reduce-scatter fusion is found too; on the wire it is
  # still an all-reduce (each device keeps a slice of the sum).
  reduce = rows[("all-reduce", False)]
  assert reduce["count"] == 2 and reduce["bytes"] == 32 + 64
  assert reduce["wire_bytes"] == pytest.approx(2 * 32 / 2 + 2 * 64 / 2)


def test_cross_slice_sends_count_what_crosses_and_mesh_groups_read_their_device_order():
  # libtpu may send a gather across slices as this slice's part; the row counts the gathered
  # result (its recv's), and each device sends its part to the other slices: (k - 1) x the part.
  text = """HloModule m

ENTRY %main (a: u8[96,64]) -> u8[96,64] {
  %s = (u8[96,64]{1,0}, u32[], token[]) send(%a, %t), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="all-gather.1_0",_xla_megascale_transfer_type="ALL_GATHER"}
  %v = (u8[2,96,64]{2,1,0}, u32[], token[]) recv(%t), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_rendezvous="all-gather.1_0",_xla_megascale_transfer_type="ALL_GATHER"}
  %r = (f32[1024]{0}, u32[], token[]) send(%b, %t), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %g = f32[8]{0} all-gather(%c), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=2], device_ids=([2,2]T(1,0)) {'axis_1'}, dimensions={0}
}
"""
  gather, reduce, mesh_gather = hlo.collectives(text, [0, 0, 1, 1])
  assert (gather.kind, gather.bytes, gather.wire_bytes, gather.dcn) == ("all-gather", 2 * 96 * 64, 96 * 64, True)
  assert (reduce.kind, reduce.wire_bytes) == ("all-reduce", 2 * 4096 / 2)
  # device_ids: the mesh numbers devices 0, 2, 1, 3, so reducing axis_1 groups {0, 2} and {1, 3}.
  assert hlo._groups(text.splitlines()[-2], 4).tolist() == [[0, 2], [1, 3]]
  assert mesh_gather.dcn and not hlo.collectives(text, [0, 1, 0, 1])[2].dcn


def test_an_async_gather_counts_once_and_cloned_loops_each_count():
  # libtpu splits an async gather into a start (data in), continuation steps (here inside
  # an inner loop that runs 4 times) and a done step, the later ones taking the chain's
  # semaphores. The forward and backward layer loops are clones: they reuse channel 1.
  text = """HloModule m

%cond (p: (s32[])) -> pred[] {
  %p = (s32[]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%start_body (x: bf16[4]) -> (bf16[16], u32[]) {
  ROOT %g = bf16[16]{0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
}

%step_body (x: bf16[16], f: u32[]) -> bf16[16] {
  ROOT %g2 = bf16[16]{0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
}

%inner (p: (s32[], u32[])) -> (s32[], u32[]) {
  %flag = u32[]{:S(2)} get-tuple-element(%p), index=1
  %more = bf16[16]{0} fusion(%buf, %flag), kind=kOutput, calls=%step_body
  ROOT %t = (s32[], u32[]) tuple(%i, %flag)
}

%forward (p: (s32[])) -> (s32[]) {
  %ag = (bf16[16]{0}, u32[]{:S(2)}) fusion(%shard), kind=kCustom, calls=%start_body
  %sem = u32[]{:S(2)} get-tuple-element(%ag), index=1
  %loop = (s32[], u32[]) while(%t0), condition=%cond, body=%inner
  %done = bf16[16]{0} fusion(%buf, %sem), kind=kCustom, calls=%step_body
  ROOT %t = (s32[]) tuple(%i)
}

%backward (p: (s32[])) -> (s32[]) {
  %ag = (bf16[16]{0}, u32[]{:S(2)}) fusion(%shard), kind=kCustom, calls=%start_body
  ROOT %t = (s32[]) tuple(%i)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %fwd = (s32[]) while(%t0), condition=%cond, body=%forward
  %bwd = (s32[]) while(%t1), condition=%cond, body=%backward
}
"""
  rows = {r["kind"]: r for r in hlo.summarize(hlo.collectives(text, [0] * 8))}
  assert rows["all-gather"]["count"] == 4 + 4  # each loop's start, 4 trips each
  assert rows["all-gather"]["bytes"] == 8 * 32


@pytest.mark.tpu
def test_cli_compile_prints_verdict_and_saves(tmp_path, capsys):
  assert main(["compile", "tiny", "data.global_batch_size=8", "--topology", "v5e-4",
               "--save", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "FITS" in out and "estimated MFU" in out and "all-gather" in out
  # Each phase is shown with its time; a tiny model gets units it needs, never 0.
  for phase in ("describing TPU topology v5e-4", "building the model", "lowering the train step",
                "compiling for v5e-4 (4 chips) (XLA)", "analysing the compiled program"):
    assert re.search(rf"^{re.escape(phase)}.*: [0-9.]+ (s|ms|µs)$", out, re.M), (phase, out)
  params = Trainer(load_config("tiny", ["data.global_batch_size=8"]), devices=jax.devices()[:1]).num_params
  assert f"{count(params)} params" in out and params > 0
  assert re.search(r"estimated step [1-9][0-9.]* (µs|ms)", out), out
  assert not re.search(r"\(0\.\d+x\)", out), out  # never a ratio under 1 against a minimum
  report = json.loads((tmp_path / "report.json").read_text())
  assert report["fits"] and report["libtpu_topology"] == "v5e:2x2"
  assert (tmp_path / "train_step.exe").stat().st_size > 0


def test_small_numbers_get_the_units_they_need():
  assert (count(853120), count(8.03e9), count(512)) == ("853.1K", "8.03B", "512")
  assert (seconds(4.75e-5), seconds(0.0123), seconds(259.4), seconds(0)) == ("47.5 µs", "12.3 ms", "259 s", "0 s")
  assert (gib(0), gib(4608), gib(3.2 * 2 ** 20), gib(3 * 2 ** 30)) == ("0 B", "4.5 KiB", "3.2 MiB", "3.00 GiB")
  traffic = {"wire_bytes": 7.0, "wire_bytes_as_written": 7.0, "minimum": {"total": 10.0}}
  assert "x)" not in traffic_line(traffic) and "at or below it" in traffic_line(traffic)
  assert traffic_line({**traffic, "wire_bytes": 10.3, "wire_bytes_as_written": 10.3}).endswith("(1.03x)")


def test_cli_compile_without_libtpu_says_so_before_loading_anything(monkeypatch, capsys):
  from jaxpar.aot import commands
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(commands.importlib.util, "find_spec",
                      lambda name, *rest: None if name == "libtpu" else find_spec(name, *rest))
  assert main(["compile", "no-such-config", "--topology", "v6e-8"]) == 2  # the config is never read
  assert "needs libtpu on this host: pip install 'jaxpar[tpu]'" in capsys.readouterr().err


@pytest.mark.tpu  # without libtpu, compile stops before it reads the topology
def test_cli_compile_without_topology_says_how_to_give_one(capsys):
  assert main(["compile", "tiny"]) == 2
  assert "pass --topology" in capsys.readouterr().err


@pytest.mark.tpu
def test_cli_compiles_the_generation_programs_of_an_8b_config(capsys):
  # One layer of llama3-8b; the benchmark (README) compiles all of them.
  assert main(["compile", "llama3-8b", "model.num_layers=1", "mesh.fsdp=1", "mesh.tensor=8", "--inference",
               "--topology", "v6e-8", "--slots", "8", "--context", "1024", "--prefill-chunk", "256"]) == 0
  out = capsys.readouterr().out
  m = load_config("llama3-8b").model
  weights = 2 * (2 * m.vocab_size * m.embed_dim + 2 * m.embed_dim * m.head_dim * (m.num_heads + m.num_kv_heads)
                 + 3 * m.embed_dim * m.mlp_dim) / 8  # bf16, split 8 ways (norms are a rounding error)
  cache = 2 * 2 * 8 * 1024 * m.num_kv_heads * m.head_dim / 8  # k and v, bf16, kv heads over tensor
  assert f"KV cache {cache / 2 ** 20:.1f} MiB" in out, out
  reported = float(out.split("weights ")[1].split(" MiB")[0])
  assert abs(reported * 2 ** 20 - weights) < 0.01 * weights, out
  assert out.count("FITS") == 2 and "decode   [8 x 1]" in out and "prefill  [1 x 256]" in out


@pytest.mark.tpu
def test_rl_collocated_on_a_slice_reports_both_phases_and_the_largest_rollout_batch(capsys):
  """grpo-tiny (with a KL reference) on v5e-4: the train step and the rollout engine's decode
  step compiled at the configured rollout batch and twice it; each phase holds what stays
  resident in the other (the optimizer state and reference while decoding, the KV pages while
  training), and the largest batch is compiled and fits."""
  from jaxpar.aot.rl_plan import format_rollout_plan, plan_rollouts
  config = load_config("grpo-tiny", ["model.num_layers=2", "model.scan_unroll=1", "objective.kl_coef=0.05",
                                     "data.global_batch_size=16", "model.compute_dtype=bfloat16"])
  plan = plan_rollouts(config, "v5e-4", most=32)
  at, largest = plan["configured"], plan["largest"]
  assert at["fits"] and at["batch"] == 16 and at["reference"] == at["params"] > 0
  assert at["rollouts"] > at["kv_pages"] + at["opt_state"] + at["reference"] + at["params"]
  # KV pages: 16 completions x ceil(105 / 16) pages x 16 slots x 2 layers x 2 (k, v) x 2 kv heads x 32, in
  # the compute dtype as the engine keeps them (bf16 over f32 weights), the whole pool on every chip (pages
  # split over kv heads only, and this mesh is fsdp=4).
  assert at["kv_pages"] == 16 * 7 * 16 * 2 * 2 * 2 * 32 * 2
  assert largest["fits"] and largest["batch"] == 32 and plan["capped"]
  assert largest["training"] > at["training"] and largest["rollouts"] > at["rollouts"]
  text = format_rollout_plan(plan)
  assert "rollout batch 16: FITS" in text and "largest rollout batch that fits: 32" in text
