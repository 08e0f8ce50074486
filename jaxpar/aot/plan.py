"""`jaxpar plan`: enumerate meshes over the axes the parallel plan says this model can use
(data, fsdp, tensor; stage, with its pipeline microbatches, repeats and schedule, where the
layers are stacked; context where attention splits; expert for MoE layers), remat policies
and microbatch counts; prune with the analytic model (cost_model.py), compile the best K,
rank what compiled. A candidate is kept only if the plan's own checks accept it.

On a TPU topology the ranking uses the compiled program (HBM fit + roofline.py); on this
host's devices (simulated CPU devices) it can also run the candidates and rank by measured
step time, reporting how well the prediction ordered them (Spearman rank correlation).
With several slices (`--num-slices`) each layout also names the axis that spans them
(stage, data or fsdp, whichever divides); the analytic model charges what crosses the slow
network at DCN bandwidth, so stage (hand-offs only) or data (one gradient all-reduce) over
DCN ranks ahead of FSDP over DCN, and the compiled candidates are multi-slice programs.
"""

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.aot import cost_model
from jaxpar.aot.chips import topology_devices
from jaxpar.aot.compile import build_report, compile_step, memory_sizes
from jaxpar.aot.cost_model import Hardware, Layout
from jaxpar.aot.phases import silent
from jaxpar.aot.xla_log import drop_xla_lines
from jaxpar.config import replace, to_yaml
from jaxpar.errors import ConfigError, UserError
from jaxpar.mesh import AXES, resolve_axis_sizes, resolve_rules
from jaxpar.parallel import ParallelPlan, PipelineConfig
from jaxpar.runtime import abstract_model, count_params
from jaxpar.train.flops import measure_matmul_flops
from jaxpar.train.trainer import Trainer

REMATS = ("none", "save_dots", "full")
MICROBATCHES = (1, 2, 4, 8)
DCN_AXES = ("stage", "data", "fsdp")
FIT_MARGIN = 0.9  # the analytic memory is rough: keep candidates within 90% of HBM


@dataclass
class Candidate:
  layout: Layout
  predicted_s: float
  predicted_bytes: float
  is_default: bool = False
  compiled: dict = field(default_factory=dict)  # fits, bytes, estimate_s (TPU)
  measured_s: float | None = None


def layout_axes(config) -> tuple[str, ...]:
  """The mesh axes a layout may give devices to: those the parallel plan allows for this
  model that the config's rules use."""
  plan = config.plan()
  used = plan.used_axes(plan.rules(resolve_rules(config.mesh.rules)))
  return tuple(a for a in plan.layout_axes(config.model, config.data.seq_len) if a in used)


def pipelines(stages: int) -> list[PipelineConfig]:
  """The pipeline choices tried for `stages`: GPipe with one and two microbatches per stage,
  and circular with two repeats (half the bubble of the first, more hand-offs)."""
  if stages == 1:
    return [PipelineConfig()]
  return [PipelineConfig(microbatches=stages), PipelineConfig(microbatches=2 * stages),
          PipelineConfig(schedule="circular", repeats=2, microbatches=stages)]


def layouts(config, num_devices: int, num_slices: int = 1) -> list[Layout]:
  """Every split of num_devices over `layout_axes` (x pipeline choices x remat x microbatches,
  x the axis spanning the slices when there are several) that the parallel plan's checks
  accept; tensor sizes that do not divide the kv heads are left out (they would replicate
  the keys and values)."""
  m = config.model
  axes = layout_axes(config)
  found = []
  for split in _factorizations(num_devices, len(axes)):
    sizes = {**dict.fromkeys(AXES, 1), **dict(zip(axes, split))}
    if m.num_kv_heads % sizes["tensor"]:
      continue
    dcn_axes = [a for a in DCN_AXES if sizes[a] % num_slices == 0] if num_slices > 1 else ["data"]
    for pipeline in pipelines(sizes["stage"]):
      parallel = config.parallel.model_copy(update={"pipeline": pipeline})
      plan = ParallelPlan(sizes, parallel)
      rules = plan.rules(resolve_rules(config.mesh.rules))
      for remat, micro in itertools.product(REMATS, MICROBATCHES):
        train = config.train.model_copy(update={"microbatches": micro})
        try:
          plan.check_training(m, config.data, train, rules)
        except ConfigError:
          continue
        found += [Layout(sizes["data"], sizes["fsdp"], sizes["tensor"], remat, micro, context=sizes["context"],
                         expert=sizes["expert"], stage=sizes["stage"], pipeline_microbatches=plan.microbatches,
                         repeats=plan.repeats, num_slices=num_slices, dcn_axis=dcn)
                  for dcn in dcn_axes]
  return found


def default_layout(config, num_devices: int, num_slices: int = 1) -> Layout:
  sizes = resolve_axis_sizes(config.mesh.axis_sizes(), num_devices)
  plan = ParallelPlan(sizes, config.parallel)
  return Layout(sizes["data"], sizes["fsdp"], sizes["tensor"], config.model.remat,
                config.train.microbatches, context=sizes["context"], expert=sizes["expert"],
                stage=sizes["stage"], pipeline_microbatches=plan.microbatches, repeats=plan.repeats,
                num_slices=num_slices, dcn_axis=config.mesh.dcn_axis if num_slices > 1 else "data")


def host_hardware(config) -> Hardware:
  """This host as the target: its measured matmul rate and memory-copy bandwidth."""
  peak = measure_matmul_flops(jnp.dtype(config.model.compute_dtype))
  buffer = np.ones(16 * 2 ** 20, np.float32)
  start = time.perf_counter()
  for _ in range(5):
    buffer.copy()
  copy_bandwidth = 5 * buffer.nbytes / (time.perf_counter() - start)
  return Hardware("host", None, peak, copy_bandwidth, copy_bandwidth, shared_host=True)


def chip_hardware(chip) -> Hardware:
  return Hardware(chip.name, chip.hbm_bytes, chip.peak_flops, chip.hbm_bandwidth,
                  chip.ici_bandwidth, shared_host=False, dcn_bandwidth=chip.dcn_bandwidth,
                  int8_flops=chip.int8_flops)


def narrower_moments(config) -> tuple[str, ...]:
  """The train.optimizer_state_dtype values a layout whose float32 moments do not fit may
  turn to, narrowest last: the config's own choice when it made one, and none for the
  optimizers that keep float32 moments (adafactor, muon, galore)."""
  t = config.train
  if t.optimizer_state_dtype != "float32" or t.optimizer not in ("adamw", "lion", "sgd"):
    return ()
  return ("bfloat16", "int8_blockwise")


def rank(config, num_devices: int, hw: Hardware, num_params: int, num_slices: int = 1,
         precisions: tuple[str, ...] = ()) -> list[Candidate]:
  """All layouts that the analytic model says fit, fastest predicted first; the config's
  own layout is always kept (marked default) so the winner can be compared with it. A layout
  that does not fit with the config's optimizer moments is tried with narrower ones (bf16,
  then 8-bit): exact moments wherever they fit, narrower ones to reach the faster layouts
  (less remat, fewer microbatches) that only fit with them. Each layout is also tried at
  every model.train_precision in `precisions` (asked for: a precision changes the numerics,
  so the planner never picks one unasked)."""
  default = default_layout(config, num_devices, num_slices)
  candidates = []
  precisions = [None] + [p for p in precisions if p != config.model.train_precision]
  for layout, precision in itertools.product(layouts(config, num_devices, num_slices), precisions):
    for moments in (None, *narrower_moments(config)):
      tried = dataclasses.replace(layout, optimizer_state=moments, train_precision=precision)
      memory = cost_model.memory_bytes(config, tried, num_params)
      if hw.hbm_bytes is None or memory <= FIT_MARGIN * hw.hbm_bytes or tried == default:
        candidates.append(Candidate(tried, cost_model.step_seconds(config, tried, num_params, hw),
                                    memory, is_default=tried == default))
        break
  return sorted(candidates, key=lambda c: c.predicted_s)


def _measure(trainer, steps: int = 5) -> float:
  """Median seconds of `steps` train steps after one warm-up, on synthetic tokens."""
  cfg = trainer.config
  rng = np.random.default_rng(0)
  shape = (cfg.data.global_batch_size, cfg.data.seq_len)
  batch = {"inputs": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32),
           "targets": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32),
           "segment_ids": np.ones(shape, np.int32),
           "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy(),
           "loss_mask": np.ones(shape, np.float32)}
  batch = {k: jax.device_put(v, trainer.batch_sharding) for k, v in batch.items()}
  state = trainer.init_state()
  state, _ = trainer.step(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def spearman(a, b) -> float:
  ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
  return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else float("nan")


def plan(config, topology: str | None = None, top: int = 3, measure: bool = False, echo=print,
         phase=silent, num_slices: int = 1, precisions: tuple[str, ...] = ()):
  """(candidates that compiled and fit, best first; all compiled candidates; the winner as a
  config; Spearman rho of predicted vs measured step times, or None without `measure`).
  `phase` (phases.py) shows which candidate is compiling."""
  if measure and topology:
    raise UserError("--measure runs candidates on this host: drop --topology to plan for it")
  if num_slices > 1 and not topology:
    raise UserError(f"--num-slices {num_slices} plans for TPU slices joined over DCN: add --topology")
  if topology:
    chip, devices = topology_devices(topology, num_slices)
    hw = chip_hardware(chip)
  else:
    chip, devices = None, jax.devices()
    hw = host_hardware(config)
  num_params = count_params(abstract_model(config.model)[1])
  for precision in precisions:  # a one-line error for a name the config does not know, before compiling
    replace(config, model={"train_precision": precision})
  ranked = rank(config, len(devices), hw, num_params, num_slices, precisions)
  slices = f" in {num_slices} slices" if num_slices > 1 else ""
  echo(f"{len(layouts(config, len(devices), num_slices))} layouts, {len(ranked)} kept by the analytic model "
       f"on {len(devices)} {hw.name} devices{slices}; compiling the best {top}"
       f"{f' and {top} spread over the rest' if measure else ''} (and the config's own)")
  chosen = ranked[:top]
  if measure:  # also sample the rest of the ranking: near-ties alone say little about order
    rest = ranked[top:]
    chosen += [rest[i] for i in sorted(set(np.linspace(0, len(rest) - 1, top).astype(int)))
               ] if rest else []
  chosen += [c for c in ranked if c.is_default and c not in chosen]
  for i, candidate in enumerate(chosen, 1):
    with phase(f"candidate {i}/{len(chosen)}: {candidate.layout}"), drop_xla_lines():
      _compile_one(config, candidate, devices, chip, topology, measure)
  ok = [c for c in chosen if c.compiled.get("fits")]
  if not ok:
    raise UserError("no candidate fits: use a bigger topology or a smaller global batch")
  key = ((lambda c: c.measured_s) if measure else
         (lambda c: c.compiled["estimate_s"]) if chip else (lambda c: c.predicted_s))
  ok.sort(key=key)
  rho = spearman([c.predicted_s for c in ok], [c.measured_s for c in ok]) if measure else None
  winner = replace(config, **ok[0].layout.overrides())
  return ok, chosen, winner, rho


def _compile_one(config, candidate, devices, chip, topology, measure):
  try:
    trainer = Trainer(replace(config, **candidate.layout.overrides()), devices)
  except UserError as e:  # a split the model's shapes reject
    candidate.compiled = {"fits": False, "error": str(e)}
    return
  compiled, oom = compile_step(trainer)
  if chip is not None:
    report = build_report(trainer, compiled, oom, chip, topology, candidate.layout.num_slices)
    candidate.compiled = {"fits": report["fits"],
                          "bytes": report.get("memory", {}).get("total"),
                          "estimate_s": report.get("estimate", {}).get("step_s"),
                          "mfu": report.get("estimate", {}).get("mfu"),
                          "collectives": report.get("collectives", [])}
    return
  memory = memory_sizes(compiled.memory_analysis())
  candidate.compiled = {"fits": True, "bytes": memory["total"] - memory["code"]}
  if measure:
    candidate.measured_s = _measure(trainer)


def format_table(candidates) -> str:
  lines = [f"{'#':>2} {'layout':<86} {'pred s':>9} {'pred GiB':>9} {'comp GiB':>9} "
           f"{'est s':>8} {'est MFU':>8} {'meas s':>8}  collectives"]
  for i, c in enumerate(candidates, 1):
    k = c.compiled
    colls = ", ".join(f"{r['kind']}x{r['count']}" for r in k.get("collectives", [])[:3])
    fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
    lines.append(f"{i:>2} {str(c.layout) + (' (config)' if c.is_default else ''):<86} "
                 f"{c.predicted_s:>9.3g} {c.predicted_bytes / 2 ** 30:>9.3f} "
                 f"{fmt(k.get('bytes') and k['bytes'] / 2 ** 30, '9.3f'):>9} "
                 f"{fmt(k.get('estimate_s'), '8.3g'):>8} "
                 f"{fmt(k.get('mfu') and 100 * k['mfu'], '7.1f'):>8} "
                 f"{fmt(c.measured_s, '8.3g'):>8}  {colls}")
  return "\n".join(lines)


def run_plan(config, topology=None, top=3, measure=False, output="plan.yaml", echo=print, phase=silent,
             num_slices=1, precisions=()):
  ok, chosen, winner, rho = plan(config, topology, top, measure, echo, phase, num_slices, precisions)
  echo(format_table(ok))
  failed = [c for c in chosen if not c.compiled.get("fits")]
  for c in failed:
    echo(f"did not fit / compile: {c.layout} {c.compiled.get('error', '')}")
  if rho is not None:
    echo(f"Spearman rank correlation, predicted vs measured step time: {rho:.2f} "
         f"over {len(ok)} candidates")
    predicted_best = min(ok, key=lambda c: c.predicted_s)
    default = next(c for c in chosen if c.is_default)
    echo(f"measured: predicted winner ({predicted_best.layout}) {predicted_best.measured_s:.4f} s, "
         f"measured winner {ok[0].measured_s:.4f} s, config's layout {default.measured_s:.4f} s")
  Path(output).write_text(to_yaml(winner))
  echo(f"winner: {ok[0].layout}; written to {output} (jaxpar train {output})")
  return ok, rho


def _factorizations(n: int, parts: int):
  """Every ordered tuple of `parts` positive integers whose product is n."""
  if parts == 1:
    yield (n,)
    return
  for first in (k for k in range(1, n + 1) if n % k == 0):
    for rest in _factorizations(n // first, parts - 1):
      yield (first, *rest)
