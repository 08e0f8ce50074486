"""Plain-text rendering of a compile report (the JSON has every number)."""


def gib(n: float) -> str:
  return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def format_report(r: dict) -> str:
  mesh = " x ".join(f"{a}={s}" for a, s in r["mesh"].items()) or "single device"
  slices = f", {r['num_slices']} slices over DCN axis '{r['dcn_axis']}'" if r["dcn_axis"] else ""
  lines = [f"{r['topology']} ({r['libtpu_topology']}, {r['devices']} {r['chip']} chips{slices}); "
           f"mesh {mesh}; remat={r['remat']}, microbatches={r['microbatches']}, "
           f"{r['num_layers']} layers, {r['params'] / 1e9:.2f}B params",
           f"per device, by hand: params {gib(r['state_bytes']['params'])}, "
           f"optimizer state {gib(r['state_bytes']['opt_state'])}"]
  if r["oom"] is not None:
    lines += [f"DOES NOT FIT in {gib(r['hbm_bytes'])} HBM per chip: the compiler ran out of memory",
              f"  {r['oom']}"]
    return "\n".join(lines)
  m = r["memory"]
  lines.append("per device, compiler: " + ", ".join(
      f"{k} {gib(m[k])}" for k in ("arguments", "outputs", "aliased", "temporaries", "code")))
  verdict = "FITS" if r["fits"] else "DOES NOT FIT"
  host = f"; host memory {gib(m['host_total'])} (offloaded activations)" if m.get("host_total") else ""
  lines.append(f"{verdict}: {gib(m['total'])} of {gib(r['hbm_bytes'])} HBM per chip "
               f"({100 * m['total'] / r['hbm_bytes']:.0f}%){host}")
  e, t = r["estimate"], r["traffic"]
  compiler = (f"; compiler's optimal_seconds {r['compiler_optimal_s']:.3f} s (one loop trip)"
              if r["compiler_optimal_s"] else "; compiler's optimal_seconds unusable (<= 0)")
  sliced = (f" ({gib(t['wire_bytes_as_written'])} if the all-reduces standing for reduce-scatters "
            f"and all-gathers were those)" if t["wire_bytes_as_written"] < t["wire_bytes"] else "")
  lines += [f"FLOPs/step: model {r['model_flops_per_step']:.3e}, compiled "
            f"{r['compiled_flops_per_step']:.3e} "
            f"({r['compiled_flops_per_step'] / r['model_flops_per_step']:.2f}x: remat recompute included)",
            f"estimated step {e['step_s']:.3f} s (ops at their roofline {e['ops_s']:.3f}, ICI "
            f"{e['ici_s']:.3f}, DCN {e['dcn_s']:.3f}; {e['overlapped_s']:.3f} if collectives all "
            f"overlap) -> estimated MFU {100 * e['mfu']:.1f}% (a roofline estimate from the compiled "
            f"program, not a measurement){compiler}",
            f"collective traffic on the wire per device per step: {gib(t['wire_bytes'])}{sliced}; "
            f"this layout's minimum {gib(t['minimum']['total'])}"
            + (f" ({t['ratio']:.2f}x)" if t["ratio"] else ""),
            "collectives per step (loop trips counted), per device:",
            f"  {'kind':<20} {'link':<4} {'count':>6} {'bytes':>12} {'on wire':>12}"]
  for c in r["collectives"]:
    lines.append(f"  {c['kind']:<20} {'DCN' if c['dcn'] else 'ICI':<4} {c['count']:>6} "
                 f"{gib(c['bytes']):>12} {gib(c['wire_bytes']):>12}")
  flags = r["xla_flags"]
  listed = ", ".join(f"{k}={v}" for k, v in flags["options"].items())
  lines.append(f"XLA flags: {len(flags['options'])} set" + (f" ({listed})" if listed else ""))
  lines += [f"  {note}" for note in flags["notes"]]
  lines.append(f"compiled in {r['compile_s']:.0f} s")
  return "\n".join(lines)
