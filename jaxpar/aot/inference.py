"""Compile the generation programs (decode step and prefill chunk) for a TPU topology on a
CPU host, and say whether weights plus a KV cache of the requested size fit.

The same programs `jaxpar serve` runs (jaxpar/inference/programs.py), on abstract weights
and an abstract paged cache laid out by the config's mesh and rules: per-device bytes from
the compiler's memory analysis, against the chip's HBM.
"""

import time

import jax
import jax.numpy as jnp

from jaxpar.aot.chips import topology_devices
from jaxpar.aot.compile import OOM_MARKERS, memory_sizes, per_device_bytes
from jaxpar.aot.phases import silent
from jaxpar.aot.report import gib
from jaxpar.inference.programs import Programs
from jaxpar.mesh import logical_to_sharding, num_shards
from jaxpar.models import kv_cache
from jaxpar.models.transformer import init_cache
from jaxpar.runtime import Runtime


def abstract_cache(runtime, num_pages: int, page_size: int, dtype, slots: int = 1, kv_quantization=None) -> dict:
  """The paged KV cache as sharded ShapeDtypeStructs (nothing allocated), laid out as the
  engine lays it out (local layers' rings where local and global layers mix; quantized pages
  and a float tail page per slot with `kv_quantization`)."""
  cfg = runtime.model_config
  repeat = kv_cache.head_repeat(cfg, num_shards("cache_kv_heads", runtime.mesh, runtime.rules))
  shapes = jax.eval_shape(lambda: init_cache(cfg, num_pages, page_size, jnp.dtype(dtype), slots=slots,
                                             kv_quantization=kv_quantization, kv_repeat=repeat))
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=logical_to_sharding(
      kv_cache.STACKED_NAMES, s.shape, runtime.mesh, runtime.rules)), shapes)


def compile_inference(config, topology: str, *, slots: int, context: int, page_size: int = 128,
                      chunk: int | None = 512, param_dtype: str = "bfloat16", compute_dtype: str | None = None,
                      num_slices: int = 1, phase=silent) -> dict:
  """Report dict for the decode step ([slots, 1]) and one prefill chunk ([1, chunk]; none
  when chunk is None) of `config`'s model with `param_dtype` weights, computing in
  `compute_dtype` (default: param_dtype), and a cache holding `slots` x `context` tokens in
  the compute dtype, as the engine keeps it. `phase`: see phases.py."""
  with phase(f"describing TPU topology {topology}"):
    chip, devices = topology_devices(topology, num_slices)
  compute_dtype = compute_dtype or param_dtype
  model = config.model.model_copy(update={"param_dtype": param_dtype, "compute_dtype": compute_dtype})
  with phase("building the model (abstract, sharded)"):
    runtime = Runtime(model, config.mesh, devices, parallel=config.parallel)
  params, model_state = runtime.abstract_targets()
  pages_per_seq = -(-context // page_size)
  cache = abstract_cache(runtime, slots * pages_per_seq, page_size, compute_dtype, slots)
  programs = Programs(runtime, params, model_state, cache)
  report = {"topology": topology, "chip": chip.name, "devices": runtime.mesh.size,
            "mesh": {a: s for a, s in runtime.mesh.shape.items() if s > 1}, "hbm_bytes": chip.hbm_bytes,
            "param_dtype": param_dtype, "quantization": model.quantization and model.quantization.mode,
            "slots": slots, "context": context, "page_size": page_size,
            "weights_bytes": per_device_bytes(params), "cache_bytes": per_device_bytes(cache),
            "programs": {}}
  for kind, batch, length in (("step", slots, 1), ("fill", 1, chunk))[:2 if chunk else 1]:
    started = time.perf_counter()
    name = "decode" if kind == "step" else "prefill"
    try:
      with phase(f"compiling {name} [{batch} x {length}] for {topology}"):
        programs.compile(kind, batch, length, pages_per_seq)
    except Exception as e:  # XLA raises a bare runtime error when the program does not fit
      if not any(marker in str(e) for marker in OOM_MARKERS):
        raise
      report["programs"][name] = {"shape": [batch, length], "fits": False, "oom": str(e).splitlines()[0][:300],
                                  "compile_s": time.perf_counter() - started}
      continue
    compiled = programs.compiled[kind, batch, length, pages_per_seq]
    memory = memory_sizes(compiled.memory_analysis())
    report["programs"][name] = {
        "shape": [batch, length], "arguments": memory["arguments"],
        "temporaries": memory["temporaries"], "total": memory["total"],
        "fits": memory["total"] <= chip.hbm_bytes,
        "pallas_calls": compiled.as_text().count("tpu_custom_call"), "compile_s": time.perf_counter() - started}
  return report


def _quantized(r) -> str:
  return f" ({r['quantization']} projections)" if r.get("quantization") else ""


def format_inference_report(r: dict) -> str:
  mesh = " x ".join(f"{a}={s}" for a, s in r["mesh"].items()) or "single device"
  lines = [f"{r['topology']} ({r['devices']} {r['chip']} chips); mesh {mesh}; "
           f"{r['param_dtype']} weights{_quantized(r)}; "
           f"KV cache for {r['slots']} sequences x {r['context']} tokens (pages of {r['page_size']})",
           f"per device, by hand: weights {gib(r['weights_bytes'])}, KV cache {gib(r['cache_bytes'])}"]
  for name, p in r["programs"].items():
    if "oom" in p:
      lines.append(f"{name:<8} [{p['shape'][0]} x {p['shape'][1]}]: DOES NOT FIT ({p['oom']})")
      continue
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    lines.append(f"{name:<8} [{p['shape'][0]} x {p['shape'][1]}]: {verdict}, {gib(p['total'])} of "
                 f"{gib(r['hbm_bytes'])} HBM per chip (arguments {gib(p['arguments'])}, temporaries "
                 f"{gib(p['temporaries'])}); compiled in {p['compile_s']:.0f} s")
  return "\n".join(lines)
