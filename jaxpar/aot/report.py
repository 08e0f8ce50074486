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
  lines.append(f"{verdict}: {gib(m['total'])} of {gib(r['hbm_bytes'])} HBM per chip "
               f"({100 * m['total'] / r['hbm_bytes']:.0f}%)")
  e = r["estimate"]
  compiler = (f"; compiler's optimal_seconds {r['compiler_optimal_s']:.3f} s (one loop trip)"
              if r["compiler_optimal_s"] else "; compiler's optimal_seconds unusable (<= 0)")
  lines += [f"model FLOPs/step {r['model_flops_per_step']:.3e}; estimated step {e['step_s']:.3f} s "
            f"(compute {e['compute_s']:.3f}, ICI {e['ici_s']:.3f}, DCN {e['dcn_s']:.3f}, "
            f"HBM {e['memory_s']:.3f}; {e['overlapped_s']:.3f} if collectives all overlap) "
            f"-> estimated MFU {100 * e['mfu']:.1f}% (a roofline "
            f"estimate, not a measurement){compiler}",
            "collectives per step (loop trips counted), per device:",
            f"  {'kind':<20} {'link':<4} {'count':>6} {'bytes':>12} {'on wire':>12}"]
  for c in r["collectives"]:
    lines.append(f"  {c['kind']:<20} {'DCN' if c['dcn'] else 'ICI':<4} {c['count']:>6} "
                 f"{gib(c['bytes']):>12} {gib(c['wire_bytes']):>12}")
  lines.append(f"compiled in {r['compile_s']:.0f} s")
  return "\n".join(lines)
