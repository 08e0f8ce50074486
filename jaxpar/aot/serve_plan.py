"""`jaxpar plan --serve`: how to serve a model on a TPU slice, compile-checked.

Candidates: every split of the slice's chips into R replicas (`jaxpar serve --replicas R`,
R dividing the chips) of one engine each, the engine's chips laid out as tensor x expert x
data (rows), with every axis size the model's shapes accept (the runtime's own checks), and
each KV cache dtype (bfloat16, int8). FSDP is not one: it gathers every weight every step.

With a workload (`--output-tokens O`, prompts of `--prompt-tokens P`, an optional
`--itl-slo`), disaggregated prefill and decode (`--prefill-devices`: half the chips prefill,
half decode, each an engine of the same layout) are candidates too, and candidates rank by the
tokens/s they serve while every prompt is prefilled, within the inter-token latency bound
first. Without one they rank by decode tokens/s, where a split only gives decoding fewer chips.

For each candidate, from the abstract sharded weights and cache (exact bytes, nothing
allocated): weights per chip, KV bytes per cached token per chip, and so the most tokens a
chip holds (HBM x HBM_USABLE - weights) and the slots a replica decodes at `--context` (at
most `--max-slots`). Then a roofline ESTIMATE, never a measurement:

  decode step (one replica, every slot decoding, sequences half-way through the context)
    = max(FLOPs / peak, HBM bytes / bandwidth) + collectives / ICI bandwidth
      FLOPs      2 x active parameters x slots + attention (4 x layers x heads x head_dim x
                 cached tokens), over the replica's chips
      bytes      the chip's weights + the chip's KV cache of the slots
      collectives  tensor: two all-reduces of [slots, embed] per layer (ring: 2(t-1)/t of it
                 on the wire); expert: the routed tokens there and back per MoE layer
  decode tokens/s = replicas x slots / step
  TTFT       one prompt of `--context` tokens on an idle replica, the same way

  With a workload, prefill = one P-token prompt the same way (plus, disaggregated, its KV
  pages over ICI to the decode chips). Co-located, a replica prefills a new prompt each time
  one of its slots finishes (slots / O per step), between decode steps: ITL = step + slots / O
  x prefill, served tokens/s = replicas x slots / ITL. Disaggregated: ITL = the decode step
  alone, served tokens/s = min(slots / step, O / prefill) (decode or prefill bound).

Active parameters count each MoE layer's experts at experts_per_token / num_experts. The
best `--top` by decode tokens/s are compiled for the topology (the engine's own decode step
and a prefill chunk, as `jaxpar compile --inference` does): the compiler's memory analysis
says whether they fit, and the roofline of the compiled decode program (roofline.py) gives
a second estimate. The winner is the fastest that fits by that estimate; its serve command
is written to `--output`. A model that fits no candidate gets the smallest slice of the same
chip that holds its weights and one sequence (by the same bytes), named in the error.
"""

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import yaml

from jaxpar.aot import hlo, roofline
from jaxpar.aot.chips import parse_slice, topology_devices
from jaxpar.aot.compile import OOM_MARKERS, memory_sizes, per_device_bytes
from jaxpar.aot.inference import abstract_cache
from jaxpar.aot.phases import silent
from jaxpar.errors import ConfigError, UserError
from jaxpar.inference.programs import Programs
from jaxpar.models.layer_pattern import layer_mixer, local_window
from jaxpar.models.kv_quant import KVQuantization
from jaxpar.runtime import Runtime

HBM_USABLE = 0.9  # of each chip's HBM for weights and cache: the rest for the programs' temporaries
KV_DTYPES = ("bfloat16", "int8")
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Workload:
  """What a served request looks like: prompt and completion tokens, and the bound on
  inter-token latency candidates are held to first (None: none)."""
  prompt_tokens: int
  output_tokens: int
  itl_slo_s: float | None = None


@dataclass
class ServeCandidate:
  replicas: int
  mesh: dict  # one replica's (or, disaggregated, each engine's) axis sizes
  kv_cache: str
  prefill_devices: int = 0  # disaggregated: the chips that prefill (as many decode); 0: co-located
  weights_bytes: int = 0  # per chip
  kv_bytes_per_token: float = 0.0  # per chip
  tokens_per_chip: int = 0  # cached tokens one chip holds beside its weights
  slots: int = 0  # per replica, at the context
  decode_tokens_s: float = 0.0  # estimate, the whole slice
  ttft_s: float = 0.0  # estimate
  prefill_s: float = 0.0  # estimate, one workload prompt (with a workload)
  itl_s: float = 0.0  # estimate under the workload
  served_tokens_s: float = 0.0  # estimate under the workload, the whole slice
  compiled: dict = field(default_factory=dict)  # fits, bytes, decode_tokens_s (from the compiled program)

  def __str__(self):
    mesh = " x ".join(f"{a}={s}" for a, s in self.mesh.items() if s > 1) or "1 chip"
    if self.prefill_devices:
      return f"P/D {self.prefill_devices}+{self.prefill_devices} x [{mesh}] kv {self.kv_cache}"
    return f"{self.replicas} x [{mesh}] kv {self.kv_cache}"

  def command(self, run: str = "RUN") -> str:
    mesh = " ".join(f"mesh.{a}={s}" for a, s in self.mesh.items() if s > 1)
    replicas = f" --replicas {self.replicas}" if self.replicas > 1 else ""
    prefill = f" --prefill-devices {self.prefill_devices}" if self.prefill_devices else ""
    kv = " --kv-cache int8" if self.kv_cache == "int8" else ""
    return f"jaxpar serve {run} {mesh} mesh.fsdp=1{replicas}{prefill} --slots {self.slots}{kv}".replace("  ", " ")

  def engine_chips(self, chips: int) -> int:
    """Chips of one engine on a slice of `chips`."""
    return self.prefill_devices or chips // self.replicas

  def rank(self, workload: Workload | None, compiled: bool = False) -> tuple:
    """Sort key, best first: decode tokens/s; with a workload, within the ITL bound first,
    then the tokens/s served."""
    rate = self.compiled["decode_tokens_s"] if compiled else self.decode_tokens_s
    if workload is None:
      return (-rate, self.ttft_s)
    served = self.compiled["served_tokens_s"] if compiled else self.served_tokens_s
    itl = self.compiled["itl_s"] if compiled else self.itl_s
    late = workload.itl_slo_s is not None and itl > workload.itl_slo_s
    return (late, -served, self.ttft_s)


def meshes(config, chips: int):
  """(replicas, one replica's {data, expert, tensor}) splits of `chips`."""
  moe = getattr(config.model, "moe", None) is not None
  for replicas in (r for r in range(1, chips + 1) if chips % r == 0):
    per = chips // replicas
    for tensor, expert in itertools.product(_divisors(per), _divisors(per) if moe else [1]):
      if per % (tensor * expert) == 0:
        yield replicas, {"data": per // (tensor * expert), "expert": expert, "tensor": tensor}


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def active_parameters(config, params) -> float:
  """Parameters a token passes through: MoE experts counted at experts_per_token / num_experts."""
  moe, total = getattr(config.model, "moe", None), 0.0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    size = math.prod(x.shape)
    routed = moe is not None and "router" not in jax.tree_util.keystr(path) and moe.num_experts in x.shape[1:] \
        and len(x.shape) >= 3
    total += size * moe.experts_per_token / moe.num_experts if routed else size
  return total


def _mesh(config, sizes: dict):
  """The config's mesh (its rules) with one replica's axis sizes, no FSDP."""
  return config.mesh.model_copy(update={**sizes, "fsdp": 1, "stage": 1, "context": 1, "num_slices": 1})


def _kv_quantization(kv: str, page_size: int):
  return KVQuantization(kv, page_size, 0) if kv == "int8" else None


def measure_bytes(config, mesh: dict, devices, page_size: int, kv_dtypes) -> tuple:
  """(weights bytes per chip, {kv dtype: KV bytes per cached token per chip}, the abstract
  weights) of one replica's mesh on `devices`, from the abstract sharded trees."""
  runtime = Runtime(config.model, _mesh(config, mesh), devices)
  params, _ = runtime.abstract_targets()
  pages = 64 * len(devices)  # many pages: a per-chip share that does not round
  per_token = {}
  for kv in kv_dtypes:
    try:
      sizes = [per_device_bytes(abstract_cache(runtime, n, page_size, "bfloat16", 1, _kv_quantization(kv, page_size)))
               for n in (pages, 2 * pages)]
    except ConfigError:  # a cache this model does not keep (multi-head latent attention's is float only)
      continue
    per_token[kv] = (sizes[1] - sizes[0]) / (pages * page_size)
  return per_device_bytes(params), per_token, params


def estimate(config, candidate: ServeCandidate, chip, active: float, chips_per_replica: int, context: int,
             workload: Workload | None = None):
  """The roofline decode tokens/s of the slice and TTFT of one prompt; with a workload, the
  prefill of its prompt, the ITL and the tokens/s served (the module doc)."""
  m = config.model
  tensor, expert = candidate.mesh["tensor"], candidate.mesh["expert"]
  attention = 4 * m.num_layers * m.num_heads * m.head_dim  # FLOPs per (query, cached key)
  moe = getattr(m, "moe", None)
  moe_layers = m.num_layers if moe is not None else 0
  k = moe.experts_per_token if moe is not None else 0

  def step_s(tokens: int, cached: float, cache_bytes: float) -> float:
    flops = (2 * active * tokens + attention * tokens * cached) / chips_per_replica
    memory = candidate.weights_bytes + cache_bytes
    wire = m.num_layers * 2 * tokens * m.embed_dim * 2 * 2 * (tensor - 1) / tensor
    wire += moe_layers * 2 * tokens * k * m.embed_dim * 2 * (expert - 1) / expert
    return max(flops / chip.peak_flops, memory / chip.hbm_bandwidth) + wire / chip.ici_bandwidth
  slots = candidate.slots
  decode = step_s(slots, context / 2, candidate.kv_bytes_per_token * slots * context / 2)
  candidate.decode_tokens_s = candidate.replicas * slots / decode
  candidate.ttft_s = step_s(context, context / 2, candidate.kv_bytes_per_token * context)
  if workload is not None:
    p = workload.prompt_tokens
    candidate.prefill_s = step_s(p, p / 2, candidate.kv_bytes_per_token * p)
    if candidate.prefill_devices:  # each chip's share of the prompt's pages, to a decode chip
      candidate.prefill_s += candidate.kv_bytes_per_token * p / chip.ici_bandwidth
    candidate.itl_s, candidate.served_tokens_s = serve_rate(candidate, decode, workload)


def serve_rate(candidate: ServeCandidate, decode_s: float, workload: Workload) -> tuple[float, float]:
  """(ITL, tokens/s served by the slice) at a decode step of `decode_s` (the module doc)."""
  slots, output = candidate.slots, workload.output_tokens
  if candidate.prefill_devices:
    return decode_s, min(slots / decode_s, output / candidate.prefill_s)
  itl = decode_s + slots / output * candidate.prefill_s
  return itl, candidate.replicas * slots / itl


def hands_over_pages(model) -> bool:
  """Whether disaggregated serving can move this model's whole cache as pool pages: not local
  layers' window rings nor linear attention's states (the engine refuses those pairs)."""
  mixers = {layer_mixer(model, i) for i in range(model.num_layers)}
  return local_window(model) is None and "gated_deltanet" not in mixers


def layouts(config, chips: int, workload: Workload | None):
  """(replicas, one engine's mesh, prefill chips) of every candidate: the co-located splits,
  and with a workload the disaggregated halves (one engine of each layout of half the chips)."""
  for replicas, mesh in meshes(config, chips):
    yield replicas, mesh, 0
  if workload is not None and chips % 2 == 0 and hands_over_pages(config.model):
    for replicas, mesh in meshes(config, chips // 2):
      if replicas == 1:
        yield 1, mesh, chips // 2


def candidates(config, topology: str, context: int, max_slots: int, page_size: int, kv_dtypes=KV_DTYPES,
               devices=None, chip=None, workload: Workload | None = None):
  """(every candidate the model's shapes accept, estimated, best first; those that hold no
  sequence of `context`; the model's active parameters)."""
  if devices is None:
    chip, devices = topology_devices(topology)
  kept, full = [], []
  active = None
  for replicas, mesh, prefill in layouts(config, len(devices), workload):
    group = devices[:prefill or len(devices) // replicas]
    try:
      weights, per_token, params = measure_bytes(config, mesh, group, page_size, kv_dtypes)
    except (ConfigError, UserError):  # a split the model's shapes reject
      continue
    active = active if active is not None else active_parameters(config, params)
    for kv, kv_bytes in per_token.items():
      candidate = ServeCandidate(replicas, mesh, kv, prefill, weights, kv_bytes)
      room = chip.hbm_bytes * HBM_USABLE - candidate.weights_bytes
      candidate.tokens_per_chip = max(int(room // candidate.kv_bytes_per_token), 0)
      candidate.slots = min(candidate.tokens_per_chip // context, max_slots)
      if candidate.slots < 1:
        full.append(candidate)
        continue
      estimate(config, candidate, chip, active, len(group), context, workload)
      kept.append(candidate)
  kept.sort(key=lambda c: c.rank(workload))
  return kept, full, active


def compile_candidate(config, candidate: ServeCandidate, devices, chip, context: int, page_size: int,
                      tries: int = 3, workload: Workload | None = None):
  """Compile one engine's decode step and a prefill chunk (disaggregated: the two engines
  share a layout, so one compile stands for both): fit by the compiler's memory analysis,
  decode tokens/s (and with a workload ITL and tokens/s served) by the compiled program's
  roofline. Where the programs' temporaries do not fit beside the bytes estimated, the slots
  are halved and it compiles again (`tries` compiles in all)."""
  runtime = Runtime(config.model, _mesh(config, candidate.mesh), devices)
  params, model_state = runtime.abstract_targets()
  pages_per_seq = -(-context // page_size)
  kv = _kv_quantization(candidate.kv_cache, page_size)
  started = time.perf_counter()
  for _ in range(tries):
    result = _compile_programs(runtime, params, model_state, kv, candidate.slots, pages_per_seq, context, page_size,
                               chip)
    if result["fits"] or candidate.slots == 1:
      break
    candidate.slots = max(candidate.slots // 2, 1)
  step = result.pop("step_s", None)
  candidate.compiled = {**result, "compile_s": time.perf_counter() - started,
                        "decode_tokens_s": candidate.replicas * candidate.slots / step if step else 0.0}
  if workload is not None:
    itl, served = serve_rate(candidate, step, workload) if step else (float("inf"), 0.0)
    candidate.compiled.update(itl_s=itl, served_tokens_s=served)


def _compile_programs(runtime, params, model_state, kv, slots, pages_per_seq, context, page_size, chip) -> dict:
  """{fits, bytes (the larger program's total), step_s (the compiled decode step's roofline)}."""
  cache = abstract_cache(runtime, slots * pages_per_seq, page_size, "bfloat16", slots, kv)
  programs = Programs(runtime, params, model_state, cache, kv)
  totals, step = [], None
  for kind, batch, length in (("step", slots, 1), ("fill", 1, min(PREFILL_CHUNK, context))):
    try:
      programs.compile(kind, batch, length, pages_per_seq)
    except Exception as e:  # XLA raises a bare runtime error when the program does not fit
      if not any(marker in str(e) for marker in OOM_MARKERS):
        raise
      return {"fits": False, "bytes": None, "error": str(e).splitlines()[0][:300]}
    compiled = programs.compiled[kind, batch, length, pages_per_seq]
    totals.append(memory_sizes(compiled.memory_analysis())["total"])
    if kind == "step":
      module = hlo.Module(compiled.as_text())
      devices = runtime.mesh.size
      step = roofline.estimate(chip, module, hlo.summarize(hlo.collectives(module, [0] * devices))).step_s
  return {"fits": max(totals) <= chip.hbm_bytes, "bytes": max(totals), "step_s": step}


def smallest_fitting_slice(config, chip, device, context: int, page_size: int) -> str | None:
  """The smallest slice of `chip` whose chips hold the weights and one sequence of `context`
  when every array shards evenly over them (by the bytes of a one-chip layout on `device`)."""
  weights, per_token, _ = measure_bytes(config, {"data": 1, "expert": 1, "tensor": 1}, [device], page_size, KV_DTYPES)
  need = weights + min(per_token.values()) * context
  for chips in (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048):
    name = f"{chip.name}-{chips * chip.cores_per_chip}"
    try:
      parse_slice(name)
    except ConfigError:
      continue
    if need / chips <= chip.hbm_bytes * HBM_USABLE:
      return name
  return None


def plan_serving(config, topology: str, *, context: int, max_slots: int = 256, page_size: int = 128, top: int = 3,
                 run: str = "RUN", echo=print, phase=silent, workload: Workload | None = None):
  """(candidates compiled and fitting, best first; every estimated candidate; the winner's
  serve command). Weights are served in bfloat16 (as `jaxpar compile --inference` sizes them)
  unless the model section quantizes them."""
  model = config.model.model_copy(update={"param_dtype": "bfloat16", "compute_dtype": "bfloat16"})
  config = config.model_copy(update={"model": model})
  if workload is not None and not 0 < workload.prompt_tokens < context:
    raise ConfigError(f"--prompt-tokens {workload.prompt_tokens} must be under --context {context}: a prompt "
                      "leaves room for its completion")
  chip, devices = topology_devices(topology)
  with phase(f"sizing the candidates on {topology}"):
    kept, _, active = candidates(config, topology, context, max_slots, page_size, devices=devices, chip=chip,
                                 workload=workload)
  if not kept:
    smallest = smallest_fitting_slice(config, chip, devices[0], context, page_size)
    where = f"the smallest {chip.name} slice that holds it is {smallest}" if smallest else \
        f"no {chip.name} slice holds it"
    quantizable = not config.model.quantization and getattr(config.model, "moe", None) is None
    quantize = ", or quantize its weights (model.quantization.mode=int8)" if quantizable else ""
    raise UserError(f"{config.model.family or 'the model'} does not fit {topology} with a {context}-token sequence "
                    f"in any layout with bfloat16 weights: {where}{quantize}")
  echo(f"{len(kept)} candidates fit by their bytes; compiling the best {min(top, len(kept))} for {topology}")
  for i, candidate in enumerate(kept[:top], 1):
    with phase(f"candidate {i}/{min(top, len(kept))}: {candidate}"):
      group = devices[:candidate.engine_chips(len(devices))]
      compile_candidate(config, candidate, group, chip, context, page_size, workload=workload)
    estimate(config, candidate, chip, active, len(group), context, workload)  # at the slots that compiled
  ok = sorted((c for c in kept[:top] if c.compiled["fits"]), key=lambda c: c.rank(workload, compiled=True))
  if not ok:
    raise UserError(f"none of the {top} best candidates fits {topology} once compiled: raise --top, lower "
                    "--max-slots or --context")
  return ok, kept, ok[0].command(run)


def format_serve_table(kept, context: int, workload: Workload | None = None) -> str:
  served = f" {'est ITL':>8} {'served':>10} {'comp ITL':>8} {'comp served':>11}" if workload else ""
  units = f" {'ms':>8} {'tok/s':>10} {'ms':>8} {'tok/s':>11}" if workload else ""
  lines = [f"{'#':>2} {'candidate':<44} {'weights':>8} {'KV/tok':>8} {'tok/chip':>9} {'slots':>5} "
           f"{'est tok/s':>10} {'est TTFT':>9} {'compiled':>9} {'comp tok/s':>10}{served}",
           f"{'':>2} {'':<44} {'GiB/chip':>8} {'KiB':>8} {'':>9} {'':>5} {'(roofline)':>10} {'s':>9} {'':>9} "
           f"{'':>10}{units}"]
  for i, c in enumerate(kept, 1):
    k = c.compiled
    fits = "-" if not k else "OOM" if k["bytes"] is None else \
        f"{'fits' if k['fits'] else 'NO'} {k['bytes'] / 2 ** 30:.1f}G"
    rate = f"{k['decode_tokens_s']:>10,.0f}" if k else f"{'-':>10}"
    under = ""
    if workload:
      comp = f" {k['itl_s'] * 1e3:>8.2f} {k['served_tokens_s']:>11,.0f}" if k.get("itl_s") else f" {'-':>8} {'-':>11}"
      under = f" {c.itl_s * 1e3:>8.2f} {c.served_tokens_s:>10,.0f}{comp}"
    lines.append(f"{i:>2} {str(c):<44} {c.weights_bytes / 2 ** 30:>8.2f} {c.kv_bytes_per_token / 1024:>8.1f} "
                 f"{c.tokens_per_chip:>9,} {c.slots:>5} {c.decode_tokens_s:>10,.0f} {c.ttft_s:>9.3f} "
                 f"{fits:>9} {rate}{under}")
  load = (f"; {workload.prompt_tokens}-token prompts, {workload.output_tokens}-token completions"
          + (f", ITL bound {workload.itl_slo_s * 1e3:g} ms" if workload.itl_slo_s else "")) if workload else ""
  lines.append(f"(estimates, not measurements: the roofline of jaxpar/aot/serve_plan.py at a {context}-token "
               f"context{load})")
  return "\n".join(lines)


def run_serve_plan(config, topology: str, *, context: int, max_slots: int, page_size: int, top: int, output: str,
                   run: str = "RUN", echo=print, phase=silent, workload: Workload | None = None):
  ok, kept, command = plan_serving(config, topology, context=context, max_slots=max_slots, page_size=page_size,
                                   top=top, run=run, echo=echo, phase=phase, workload=workload)
  echo(format_serve_table(kept[:max(top, 10)], context, workload))
  winner = ok[0]
  estimated = {"decode_tokens_s": round(winner.compiled["decode_tokens_s"]), "ttft_s": round(winner.ttft_s, 4)}
  if workload is not None:
    estimated.update(itl_s=round(winner.compiled["itl_s"], 5), served_tokens_s=round(winner.compiled["served_tokens_s"]))
  Path(output).write_text(yaml.safe_dump({
      "topology": topology, "context": context, "replicas": winner.replicas,
      "mesh": {a: s for a, s in winner.mesh.items() if s > 1}, "slots": winner.slots, "kv_cache": winner.kv_cache,
      **({"prefill_devices": winner.prefill_devices} if winner.prefill_devices else {}),
      **({"workload": {"prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens,
                       "itl_slo_s": workload.itl_slo_s}} if workload else {}),
      "estimate": estimated, "command": command}, sort_keys=False))
  echo(f"winner: {winner}; written to {output}:\n  {command}")
  return ok, kept
