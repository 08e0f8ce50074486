"""Compile the real train step for a TPU topology on a CPU host and report whether it fits,
what it communicates and how fast it would run (an estimate; see roofline.py)."""

import json
import math
import pickle
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxpar.aot import hlo, roofline, traffic
from jaxpar.aot.chips import parse_slice, topology_devices
from jaxpar.aot.phases import silent
from jaxpar.data.loader import TOKEN_KEYS
from jaxpar.config import replace
from jaxpar.train.flops import train_flops_per_token
from jaxpar.train.trainer import Trainer

OOM_MARKERS = ("RESOURCE_EXHAUSTED", "HbmOom", "Ran out of memory")


def abstract_batch(trainer) -> dict:
  data = trainer.config.data
  shape = (data.global_batch_size, data.seq_len)
  return {k: jax.ShapeDtypeStruct(shape, jnp.int32 if k in TOKEN_KEYS else jnp.float32,
                                  sharding=trainer.batch_sharding) for k in trainer.objective.batch_keys}


def per_device_bytes(tree) -> int:
  """Bytes of one device's shards of an abstract, sharded tree (what it holds, by hand)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def compile_step(trainer, phase=silent, target: str = "the target", program=None, name="the train step"):
  """(compiled train step or None, the out-of-memory message or None). `phase`: see
  phases.py (how the lowering and compiling are shown); `program`: another jitted step of
  the trainer's (a train.sync sync), default its train step."""
  state, batch = trainer.abstract_state(), abstract_batch(trainer)
  with trainer.context():
    with phase(f"lowering {name}"):
      lowered = (program or trainer.train_step).lower(state, batch)
    try:
      with phase(f"compiling for {target} (XLA)"):
        return lowered.compile(), None
    except Exception as e:  # XLA raises a bare XlaRuntimeError for OOM
      if not any(m in str(e) for m in OOM_MARKERS):
        raise
      lines = [line for line in str(e).splitlines() if line.strip()]
      return None, " ".join(lines[:2])[:400]


def compile_for_topology(config, topology: str, num_slices: int | None = None, *, phase=silent):
  """(report dict, compiled executable or None) for `config` on `num_slices` x `topology`
  (default: the config's mesh.num_slices). `phase=jaxpar.aot.phases.Phases()` shows each
  phase with a spinner and its time."""
  num_slices = num_slices or config.mesh.num_slices
  if num_slices != config.mesh.num_slices:
    config = replace(config, mesh={"num_slices": num_slices})
  started = time.perf_counter()
  with phase(f"describing TPU topology {topology}" + (f" x {num_slices} slices" if num_slices > 1 else "")):
    chip, devices = topology_devices(topology, num_slices)
  with phase("building the model (abstract, sharded)"):
    trainer = Trainer(config, devices)
  compiled, oom = compile_step(trainer, phase, f"{topology} ({len(devices)} chips)")
  with phase("analysing the compiled program"):
    report = build_report(trainer, compiled, oom, chip, topology, num_slices)
  if trainer.replicas is not None and compiled is not None:
    with phase("compiling the train.sync syncs"):
      report["data_sync"] = data_sync_traffic(trainer, compiled, phase, f"{topology} ({len(devices)} chips)")
  report["compile_s"] = time.perf_counter() - started
  return report, compiled


def crossing_bytes(compiled, mesh, axis: str = "data") -> float:
  """Bytes each device sends per run of a compiled step over collectives that cross `axis`
  (ring algorithms)."""
  coords = hlo.axis_coordinates(mesh, axis)
  platform = mesh.devices.flat[0].platform
  return sum(c.wire_bytes for c in hlo.collectives(compiled.as_text(), coords, cpu=platform == "cpu") if c.dcn)


def data_sync_traffic(trainer, inner, phase=silent, target="the target") -> dict:
  """train.sync's traffic over `data`, per device, from its compiled programs: each one's
  bytes, their average per step over a sync period, and the least its syncs can send
  (ReplicaTraining.least_wire_bytes)."""
  r = trainer.replicas
  every, fragments = r.settings.every, r.settings.fragments
  programs = {"inner": crossing_bytes(inner, trainer.mesh)}
  for p in range(fragments):
    compiled, _ = compile_step(trainer, phase, target, r.program(p), f"sync {p}")
    programs[f"sync {p}"] = crossing_bytes(compiled, trainer.mesh)
  least = sum(r.least_wire_bytes(p) for p in range(fragments))
  syncs = sum(programs[f"sync {p}"] for p in range(fragments))
  return {"method": r.method, "every": every, "fragments": fragments, "bits": r.settings.bits, "programs": programs,
          "per_step": (syncs + (every - fragments) * programs["inner"]) / every, "least_per_step": least / every}


def build_report(trainer, compiled, oom, chip, topology, num_slices) -> dict:
  cfg, mesh = trainer.config, trainer.mesh
  state = trainer.abstract_state()
  model_flops = (train_flops_per_token(cfg.model, cfg.data.seq_len)
                 * cfg.data.global_batch_size * cfg.data.seq_len)
  report = {
    "topology": topology, "libtpu_topology": parse_slice(topology)[1], "num_slices": num_slices,
    "chip": chip.name, "devices": mesh.size,
    "mesh": {a: s for a, s in mesh.shape.items() if s > 1},
    "dcn_axis": cfg.mesh.dcn_axis if num_slices > 1 else None,
    "remat": cfg.model.remat, "microbatches": cfg.train.microbatches,
    "num_layers": cfg.model.num_layers, "params": trainer.num_params,
    "model_flops_per_step": model_flops,
    "hbm_bytes": chip.hbm_bytes,
    "state_bytes": {"params": per_device_bytes(state.params),
                    "opt_state": per_device_bytes(state.opt_state),
                    "frozen": per_device_bytes(state.frozen),  # a LoRA base, an RL reference
                    "opt_state_on_host": cfg.train.offload_optimizer == "host"},
    "xla_flags": {"options": trainer.xla_options, "notes": trainer.xla_notes},
    "fits": compiled is not None, "oom": oom,
  }
  if compiled is None:
    return report
  sizes = memory_sizes(compiled.memory_analysis())
  slices = [getattr(d, "slice_index", 0) or 0 for d in mesh.devices.flat]
  module = hlo.Module(compiled.as_text())
  rows = hlo.summarize(hlo.collectives(module, slices))
  est = roofline.estimate(chip, module, rows)
  minimum = traffic.minimum_wire_bytes(cfg, mesh, trainer.rules)
  measured = sum(r["wire_bytes"] for r in rows)
  # What libtpu's stand-in all-reduces would send as the reduce-scatters and all-gathers
  # the partitioner wrote (half).
  as_written = measured - sum(r["wire_bytes"] for r in rows if r["kind"] in (hlo.SLICED, hlo.GATHER)) / 2
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost
  optimal = cost.get("optimal_seconds", -1.0)
  report.update({
    "memory": sizes, "fits": sizes["total"] <= chip.hbm_bytes, "collectives": rows,
    "matmuls": hlo.matmul_types(module),
    "traffic": {"wire_bytes": measured, "wire_bytes_as_written": as_written,
                "minimum": minimum,
                "ratio": measured / minimum["total"] if minimum["total"] else None},
    # Across slices: what the collectives whose groups span slices send, beside what the
    # layout must send there (traffic.minimum_dcn_bytes).
    "dcn": {"wire_bytes": sum(r["wire_bytes"] for r in rows if r["dcn"]),
            "minimum": traffic.minimum_dcn_bytes(cfg, mesh, trainer.rules)} if num_slices > 1 else None,
    "compiled_flops_per_step": est.flops * mesh.size,
    "estimate": {"step_s": est.step_s, "overlapped_s": est.overlapped_s, "ops_s": est.ops_s,
                 "ici_s": est.ici_s, "dcn_s": est.dcn_s, "hbm_traffic_bytes": est.bytes,
                 "host_transfer_bytes": est.host_bytes,
                 "mfu": model_flops / (est.step_s * mesh.size * chip.peak_flops)},
    # One trip of each loop and sometimes negative (DESIGN.md): shown only when positive.
    "compiler_optimal_s": optimal if optimal > 0 else None,
  })
  return report


def memory_sizes(memory) -> dict:
  """Per-device bytes from the compiler's memory analysis: HBM (total) and host memory
  (host_total: what remat offload keeps in pinned host memory)."""
  sizes = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
           "aliased": memory.alias_size_in_bytes, "temporaries": memory.temp_size_in_bytes,
           "code": memory.generated_code_size_in_bytes}
  sizes["total"] = (sizes["arguments"] + sizes["outputs"] - sizes["aliased"]
                    + sizes["temporaries"] + sizes["code"])
  sizes["host_total"] = (memory.host_argument_size_in_bytes + memory.host_output_size_in_bytes
                         - memory.host_alias_size_in_bytes + memory.host_temp_size_in_bytes)
  return sizes


def save(directory, report: dict, compiled) -> Path:
  """report.json and, when it compiled, the serialized executable (train_step.exe) and its
  HLO text (train_step.hlo.txt)."""
  from jax.experimental.serialize_executable import serialize
  path = Path(directory)
  path.mkdir(parents=True, exist_ok=True)
  (path / "report.json").write_text(json.dumps(report, indent=2))
  if compiled is not None:
    with open(path / "train_step.exe", "wb") as f:
      pickle.dump(serialize(compiled), f)
    (path / "train_step.hlo.txt").write_text(compiled.as_text())
  return path
