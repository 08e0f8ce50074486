"""Quantization: one table per mode on the trained embedded default, and the per-device HBM
of an 8B decode step with int8 / int4 weights against bf16 (TPU, compile-only).

  JAX_PLATFORMS=cpu python benchmarks/quantization.py [--steps 150] [--topology v6e-4] [--no-tpu]

CPU: `tiny` trained for --steps on the bundled corpus minus its last two chapters, then
evaluated on 32 windows of 128 bytes of those chapters. Weight bytes: the projection arrays
(q/k/v/o, gate/up/down: what quantization touches; embeddings stay float) against the same
kernels in bf16, measured on the arrays. KV bytes: a quantized cache of the model's shape
(16-token pages) against a bf16 one, measured on the arrays. Logits error: max |dlogit| /
max |logit| against float32 on 8 windows. The KV rows attend as each decode step reads the
quantized cache (`kv_quant.cached_attention`; newest 32 tokens in float).
Decode (the inference engine, greedy; the float32 model as trained, and quantized): tokens/s at
batch 1 and 8 (prompts of 64 held-out bytes, 64 new tokens; decode tokens/s = batch x 63 /
(time for 64 tokens - time for 1), best of 3) and greedy agreement with the float32 model
(the share of the 64 x 8 generated tokens equal to float's at the same position), for each
weight mode with a float cache and for the float32 model with the engine's cache stored
int8 / int4 / int2 (`kv_cache=`; complete pages quantized, the newest partial page float),
with the pool bytes per cached token of each.
TPU: llama3-8b's decode step (weights bf16, int8, int4 or W8A8) (one new token for each of 8 sequences over a 4096-token paged
bf16 cache) compiled through libtpu on tensor-parallel chips; argument bytes (weights +
cache) and temporaries per device from compiled.memory_analysis().
"""

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import load_config, replace
from jaxpar.data.sources import read_documents
from jaxpar.data.tokenizer import ByteTokenizer
from jaxpar.data.heldout import split_heldout, token_windows
from jaxpar.train.evaluator import perplexity
from jaxpar.models import kv_quant
from jaxpar.convert.quantize import quantization_section
from jaxpar.weights import quantize_params, quantized_kernels
from jaxpar.runtime import Runtime
from jaxpar.train.trainer import Trainer

_GiB = 1 << 30
WEIGHT_MODES = [("int8", {}), ("int4", {"group": 32}), ("int4", {"group": 32, "zero_point": True}),
                ("w8a8", {}), ("w8a8", {"outlier_channels": 8})]


def _bytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _projection_bytes(runtime, params):
  """Bytes of the quantized projections' arrays, and of the same kernels in bf16."""
  total = bf16 = 0
  for path, kernel in quantized_kernels(runtime):
    node = params
    for key in path:
      node = node[key]
    total += _bytes(node)
    bf16 += node["values"].size * 2 * (2 if kernel.mode == "int4" else 1)
  return total, bf16


def _logits(runtime, params, tokens, kv_quantization=None):
  with runtime.context():
    return np.asarray(jax.jit(lambda p, t: runtime.merge(p)(t, kv_quantization=kv_quantization)[0])(params, tokens))


def _train(steps):
  train_docs, heldout = split_heldout(read_documents("bundled"), 2)
  source = Path(tempfile.mkdtemp()) / "train.txt"
  source.write_text("\f".join(train_docs))
  config = load_config("tiny", [f"data.source={source}", f"train.steps={steps}", "mesh.fsdp=1",
                                "data.global_batch_size=16", "checkpoint.enabled=false",
                                "train.log_every=0"])
  trainer = Trainer(config, devices=jax.devices()[:1])
  started = time.perf_counter()
  params = trainer.fit(show_progress=False).state.params
  print(f"trained tiny for {steps} steps in {time.perf_counter() - started:.0f} s")
  return config, trainer.runtime, params, token_windows(heldout, ByteTokenizer(), 128, 32)


def _row(name, weight_ratio, kv_ratio, error, ppl, base):
  cells = [name, weight_ratio, kv_ratio, "-" if error is None else f"{error:.3%}", f"{ppl:.4f}",
           f"{ppl / base - 1:+.3%}"]
  print("| " + " | ".join(cells) + " |")


def cpu_tables(steps):
  config, runtime, params, windows = _train(steps)
  quality_table(config, runtime, params, windows)
  decode_table(config, runtime, params, windows)


def quality_table(config, runtime, params, windows):
  devices = jax.devices()[:1]
  base = perplexity(runtime, params, windows)
  want = _logits(runtime, params, windows[:8, :-1])
  print("\n| mode | projection bytes vs bf16 | KV bytes vs bf16 | logits error | held-out ppl | delta |")
  print("| --- | --- | --- | --- | --- | --- |")
  _row("float32 (baseline; bytes compare with bf16)", "1", "1", None, base, base)
  for mode, options in WEIGHT_MODES:
    section = quantization_section(mode, options.get("group"), options.get("zero_point", False),
                                   options.get("outlier_channels", 0))
    q_config = replace(config, model={"quantization": section})
    q_runtime = Runtime(q_config.model, q_config.mesh, devices)
    q_params = quantize_params(params, q_runtime)
    total, bf16 = _projection_bytes(q_runtime, q_params)
    error = float(np.abs(_logits(q_runtime, q_params, windows[:8, :-1]) - want).max() / np.abs(want).max())
    name = mode + "".join(f", {k.replace('_', ' ')} {v}" for k, v in options.items())
    _row(name, f"{total / bf16:.3f}", "1", error, perplexity(q_runtime, q_params, windows), base)
  m = config.model
  pages = jnp.zeros((m.num_layers, m.num_kv_heads, 64, 16, m.head_dim), jnp.bfloat16)
  for mode in kv_quant.KV_MODES:
    spec = kv_quant.KVQuantization(mode, page_size=16, window=32)
    ratio = kv_quant.nbytes(kv_quant.quantize_pages(pages, pages, spec)) / (2 * pages.nbytes)
    got = _logits(runtime, params, windows[:8, :-1], spec)
    error = float(np.abs(got - want).max() / np.abs(want).max())
    _row(f"KV {mode} (KIVI)" if mode != "int8" else "KV int8", "1", f"{ratio:.3f}", error,
         perplexity(runtime, params, windows, kv_quantization=spec), base)


def _best(fn, repeats=3):
  fn()
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    fn()
    times.append(time.perf_counter() - started)
  return min(times)


def decode_table(config, runtime, params, windows, batches=(1, 8), new=64):
  from jaxpar.inference import Engine, SamplingParams
  devices = jax.devices()[:1]
  prompts = [w[:64].tolist() for w in windows[:max(batches)]]
  models = [("float32", runtime, params, None)]
  for mode, group in (("int8", None), ("int4", 32), ("w8a8", None)):
    q_config = replace(config, model={"quantization": quantization_section(mode, group)})
    q_runtime = Runtime(q_config.model, q_config.mesh, devices)
    models.append((mode if group is None else f"int4, group {group}", q_runtime,
                   quantize_params(params, q_runtime), None))
  models += [("float32", runtime, params, kv) for kv in ("int8", "int4", "int2")]
  print("\n| weights | KV cache | pool bytes / token | " + " | ".join(f"decode tokens/s, batch {b}" for b in batches)
        + " | greedy agreement with float32 |")
  print("| --- | --- | --- |" + " --- |" * (len(batches) + 1))
  reference = None
  for name, rt, p, kv in models:
    speeds = []
    for batch in batches:
      engine = Engine(rt, p, ByteTokenizer(), slots=batch, max_seq_len=64 + new + 8, page_size=16,
                      prefill_chunks=(64,), kv_cache=kv)
      run = lambda n: engine.generate(prompts[:batch], SamplingParams(max_tokens=n, stop_token_ids=()))
      speeds.append(batch * (new - 1) / (_best(lambda: run(new)) - _best(lambda: run(1))))
    tokens = np.array([c.tokens for c in run(new)])
    reference = tokens if reference is None else reference
    agreement = float((tokens == reference).mean())
    pool = {g: {k: v for k, v in c.items() if not k.startswith("tail")} for g, c in engine.cache.items()}
    per_token = _bytes(pool) / (engine.pool.num_pages * engine.pool.page_size)
    print(f"| {name} | {kv or 'float32'} | {per_token:,.0f} | " + " | ".join(f"{s:,.0f}" for s in speeds)
          + f" | {agreement:.1%} |")


def tpu_table(topology):
  from jaxpar.aot.inference import compile_inference
  base = load_config("llama3-8b", ["mesh.fsdp=1", "mesh.tensor=-1", "mesh.rules=tp"])
  print(f"\nllama3-8b decode step on {topology} (tensor parallel), compile-only (jaxpar compile --inference):")
  print("| weights | weights per chip | arguments per chip (weights + KV cache) | temporaries "
        "| Pallas calls | compile |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name, section in (("bf16", None), ("int8", quantization_section("int8")),
                        ("int4 (group 128)", quantization_section("int4", 128)),
                        ("w8a8", quantization_section("w8a8"))):
    config = base if section is None else replace(base, model={"quantization": section})
    report = compile_inference(config, topology, slots=8, context=4096, page_size=128, chunk=None)
    decode = report["programs"]["decode"]
    print(f"| {name} | {report['weights_bytes'] / _GiB:.2f} GiB | {decode['arguments'] / _GiB:.2f} GiB | "
          f"{decode['temporaries'] / _GiB:.2f} GiB | {decode['pallas_calls']} | {decode['compile_s']:.0f} s |")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--topology", default="v6e-4")
  parser.add_argument("--no-tpu", action="store_true")
  parser.add_argument("--no-cpu", action="store_true")
  args = parser.parse_args()
  if not args.no_cpu:
    cpu_tables(args.steps)
  if not args.no_tpu:
    tpu_table(args.topology)


if __name__ == "__main__":
  main()
