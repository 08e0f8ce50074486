"""Plain-text rendering of a compile report (the JSON has every number). Small numbers get
the units they need: a tiny model is not `0.00B params` nor a step of `0.000 s`."""


def gib(n: float) -> str:
  for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
    if n >= scale:
      return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
  return f"{n:.0f} B"


def count(n: float) -> str:
  """853120 -> '853.1K', 8.03e9 -> '8.03B'."""
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      return f"{n / scale:.{2 if unit == 'B' else 1}f}{unit}"
  return f"{n:.0f}"


def seconds(s: float) -> str:
  if s == 0:
    return "0 s"
  for unit, scale in (("s", 1.0), ("ms", 1e-3)):
    if abs(s) >= scale:
      return f"{s / scale:.3g} {unit}"
  return f"{s / 1e-6:.3g} µs"


def fit_hints(r: dict) -> str:
  """The knobs that shrink per-chip memory, for a config that does not fit."""
  hints = []
  if r["remat"] != "full":
    hints.append("recompute activations (model.remat=full, or offload named ones)")
  mesh = r["mesh"]
  if mesh.get("fsdp", 1) < r["devices"]:
    hints.append(f"shard the weights over more chips (mesh.fsdp, now {mesh.get('fsdp', 1)})")
  hints.append(f"fewer tokens per chip at once (train.microbatches={2 * r['microbatches']}, or a smaller "
               "data.global_batch_size)")
  hints.append(f"a bigger slice; `jaxpar plan CONFIG --topology {r['topology']}` searches these for you")
  return "to fit: " + "; ".join(hints)


def traffic_line(t: dict) -> str:
  """Measured collective bytes against this layout's estimated minimum: a ratio only when
  the program moves at least the minimum (below it, the estimate is what is off)."""
  line = f"collective traffic on the wire per device per step: {gib(t['wire_bytes'])}"
  if t["wire_bytes_as_written"] < t["wire_bytes"]:
    line += (f" ({gib(t['wire_bytes_as_written'])} if the all-reduces standing for reduce-scatters "
             "and all-gathers were those)")
  minimum = t["minimum"]["total"]
  if not minimum:
    return line
  line += f"; this layout's estimated minimum {gib(minimum)}"
  ratio = t["wire_bytes"] / minimum
  return line + (f" ({ratio:.2f}x)" if ratio >= 1 else " (at or below it: the estimate is conservative here)")


def dcn_line(dcn: dict, axis: str) -> str:
  """DCN bytes measured against the layout's minimum across slices, part by part."""
  minimum = dcn["minimum"]
  parts = ", ".join(f"{name} {gib(v)}" for name, v in minimum.items() if name != "total")
  ratio = f" ({dcn['wire_bytes'] / minimum['total']:.2f}x)" if minimum["total"] else ""
  return (f"across slices (DCN, '{axis}' spanning them) per device per step: {gib(dcn['wire_bytes'])}; "
          f"this layout's minimum {gib(minimum['total'])}{ratio} = {parts}")


def sync_line(sync: dict) -> str:
  """train.sync's bytes over `data`, per program and per step against the least a sync sends."""
  programs = ", ".join(f"{name} {gib(v)}" for name, v in sync["programs"].items())
  return (f"train.sync={sync['method']} (every {sync['every']} steps, {sync['fragments']} fragment(s), "
          f"{sync['bits']}-bit) over 'data' per device: {programs}; per step {gib(sync['per_step'])}, "
          f"least {gib(sync['least_per_step'])}")


def format_report(r: dict) -> str:
  mesh = " x ".join(f"{a}={s}" for a, s in r["mesh"].items()) or "single device"
  slices = f", {r['num_slices']} slices over DCN axis '{r['dcn_axis']}'" if r["dcn_axis"] else ""
  lines = [f"{r['topology']} ({r['libtpu_topology']}, {r['devices']} {r['chip']} chips{slices}); "
           f"mesh {mesh}; remat={r['remat']}, microbatches={r['microbatches']}, "
           f"{r['num_layers']} layers, {count(r['params'])} params",
           f"per device, by hand: params {gib(r['state_bytes']['params'])}, "
           f"optimizer state {gib(r['state_bytes']['opt_state'])}"
           + (" (in host memory, updated by the host)" if r["state_bytes"].get("opt_state_on_host") else "")]
  if r["oom"] is not None:
    lines += [f"DOES NOT FIT in {gib(r['hbm_bytes'])} HBM per chip: the compiler ran out of memory",
              f"  {r['oom']}", fit_hints(r)]
    return "\n".join(lines)
  m = r["memory"]
  lines.append("per device, compiler: " + ", ".join(
      f"{k} {gib(m[k])}" for k in ("arguments", "outputs", "aliased", "temporaries", "code")))
  verdict = "FITS" if r["fits"] else "DOES NOT FIT"
  host = f"; host memory {gib(m['host_total'])} (offloaded)" if m.get("host_total") else ""
  lines.append(f"{verdict}: {gib(m['total'])} of {gib(r['hbm_bytes'])} HBM per chip "
               f"({100 * m['total'] / r['hbm_bytes']:.0f}%){host}")
  if not r["fits"]:
    lines.append(fit_hints(r))
  e, t = r["estimate"], r["traffic"]
  compiler = (f"; compiler's optimal_seconds {seconds(r['compiler_optimal_s'])} (one loop trip)"
              if r["compiler_optimal_s"] else "; compiler's optimal_seconds unusable (<= 0)")
  lines += [f"FLOPs/step: model {r['model_flops_per_step']:.3e}, compiled "
            f"{r['compiled_flops_per_step']:.3e} "
            f"({r['compiled_flops_per_step'] / r['model_flops_per_step']:.2f}x: remat recompute included)",
            f"estimated step {seconds(e['step_s'])} (ops at their roofline {seconds(e['ops_s'])}, ICI "
            f"{seconds(e['ici_s'])}, DCN {seconds(e['dcn_s'])}; {seconds(e['overlapped_s'])} if collectives "
            f"all overlap) -> estimated MFU {100 * e['mfu']:.1f}% (a roofline estimate from the compiled "
            f"program, not a measurement){compiler}",
            "matmuls per step by operand types: " + ", ".join(
                f"{n:,} {types}" for types, n in r["matmuls"].items()),
            traffic_line(t),
            *([dcn_line(r["dcn"], r["dcn_axis"])] if r.get("dcn") else []),
            *([sync_line(r["data_sync"])] if r.get("data_sync") else []),
            "collectives per step (loop trips counted), per device:",
            f"  {'kind':<20} {'link':<4} {'count':>6} {'bytes':>12} {'on wire':>12}"]
  for c in r["collectives"]:
    lines.append(f"  {c['kind']:<20} {'DCN' if c['dcn'] else 'ICI':<4} {c['count']:>6} "
                 f"{gib(c['bytes']):>12} {gib(c['wire_bytes']):>12}")
  flags = r["xla_flags"]
  listed = ", ".join(f"{k}={v}" for k, v in flags["options"].items())
  lines.append(f"XLA flags: {len(flags['options'])} set" + (f" ({listed})" if listed else ""))
  lines += [f"  {note}" for note in flags["notes"]]
  lines.append(f"compiled in {seconds(r['compile_s'])}")
  return "\n".join(lines)
