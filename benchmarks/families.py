"""Model families at real size: KV-cache bytes per token of the shipped configs.

    python benchmarks/families.py [--v5p] [--v6e] [--linear] [--tiny [CONFIG ...]]

Local/global part (Gemma 2, 3 and 4, GPT-OSS): a layer with a
sliding window never reads keys further back than its window, so over a long sequence its
cache costs window / seq_len of a global layer's per token. The table gives, per model,
the bytes one token adds to every layer's cache, the cache a `seq_len`-token sequence
needs when sliding layers keep only their window, that over seq_len (the effective bytes
per token), and both against Llama 3 8B. "Engine holds" is what jaxpar's paged engine
keeps for one such sequence (pages of 16), counted by the cache code itself: the global
layers' pages for the whole sequence, and per local layer a ring of its window's pages
(models/kv_cache_windowed.py: a window plus one write of up to a window, rounded to pages).

DeepSeek-V3 part: its multi-head latent attention's latent cache against Llama 3 8B's GQA
cache and against the GQA cache DeepSeek-V3's own attention would need (128 heads of
128-wide keys and values), computed from the shipped configs by the cache code itself;
with --v5p, one DeepSeek-V3 MoE layer at real width compiled (libtpu, on this host) for a
v5p-16 slice with expert parallelism, train step and decode step, its compiled cache
checked against the latent size counted by hand (about 10 CPU-minutes).

Tiny part: with --tiny, each family's tiny config on 1 CPU device (float32): training
tokens/s (the mean of 5 steps after 2 warm-up steps, the config's batch and sequence) and
decode tokens/s (random weights, greedy, 8 prompts of 64 tokens, 64 new: batch x 63 over
the time past the first token, best of 2), against `tiny`, the Llama-style baseline.

With --linear: the linear-attention hybrids (Qwen3.5, Qwen3-Next) against softmax attention
(benchmarks/linear_attention.py): cache bytes per token at 32k, token-mixing tokens/s from 2k
to 32k on CPU, and collective bytes per layer under context parallelism by length.

With --v6e: the shipped local/global configs' full train steps, every layer, compiled
(libtpu, on this host) for the TPU slice their files name, with the per-chip HBM the
compiler's memory analysis gives (Gemma 3 12B, Gemma 4 31B and GPT-OSS 20B).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import numpy as np  # noqa: E402

from jaxpar.config import load_config, shipped_configs  # noqa: E402
import jax  # noqa: E402

from jaxpar.models import caches, kv_cache, kv_cache_latent, layer_options  # noqa: E402
from jaxpar.models.transformer import init_cache, layer_groups  # noqa: E402

LOCAL_GLOBAL = ("gemma2-9b", "gemma3-12b", "gemma4-31b", "gpt-oss-20b")
ENGINE_PAGE = 16  # the engine's default page size


def local_global_kv_cache_bytes(seq_len: int = 32768, dtype: str = "bfloat16") -> list[dict]:
  """One row per shipped model (and llama3-8b, the baseline) with its cache bytes. A layer's
  bytes per token come from the cache the engine would make (Gemma 4's global layers are
  wider than its local ones)."""
  rows = []
  for name in ("llama3-8b",) + tuple(n for n in LOCAL_GLOBAL if n in shipped_configs()):
    m = load_config(name).model
    pages = -(-seq_len // ENGINE_PAGE)
    cache = jax.eval_shape(lambda: init_cache(m, pages, ENGINE_PAGE, dtype))
    per_layer = []  # (bytes per token, window) per layer, group by group
    for group in layer_groups(m):
      parts = cache[group.name]
      k = (parts.get("full") or parts.get("windowed") or parts)["k"]  # [layers, kv_heads, pages, page, dim]
      per_layer += [(2 * k.shape[1] * k.shape[4] * np.dtype(dtype).itemsize, layer_options(m, i).attention.sliding_window)
                    for i in group.indices]
    rows.append(dict(model=name, local=sum(w is not None for _, w in per_layer),
                     glob=sum(w is None for _, w in per_layer), per_token=sum(b for b, _ in per_layer),
                     windowed=sum(b * (seq_len if w is None else min(w, seq_len)) for b, w in per_layer),
                     held=caches.cache_bytes(cache)))
  return rows


def print_local_global_kv_cache(seq_len: int = 32768):
  rows = local_global_kv_cache_bytes(seq_len)
  base = rows[0]["per_token"]
  print(f"KV-cache bytes (bf16) of a {seq_len:,}-token sequence; sliding layers keep their window\n")
  header = (f"{'model':<12} {'local/global':>12} {'new token':>10} {'windowed cache':>15} {'per token':>10} "
            f"{'x llama3-8b':>12} {'engine holds':>13}")
  print(header + "\n" + "-" * len(header))
  for r in rows:
    effective = r["windowed"] / seq_len
    held = r["held"]
    print(f"{r['model']:<12} {r['local']:>5}/{r['glob']:<6} {r['per_token']:>10,} {r['windowed'] / 2**20:>11,.0f} MiB "
          f"{effective:>10,.0f} {effective / base:>12.2f} {sum(held.values()) / 2**20:>9,.0f} MiB "
          f"({held['pool'] / 2**20:,.0f} global + {held['rings'] / 2**20:,.0f} local)")


def deepseek_kv_cache_bytes(dtype: str = "bfloat16") -> list[tuple[str, str, int, int]]:
  """(model, cache layout, layers, bytes per token over all layers), in `dtype`."""
  v3 = load_config("deepseek-v3-671b").model
  llama = load_config("llama3-8b").model
  m = v3.mla
  return [
      ("deepseek-v3-671b", f"MLA latent: {v3.num_layers} layers x ({m.kv_lora_rank} + {m.qk_rope_head_dim})",
       v3.num_layers, kv_cache_latent.bytes_per_token(v3, dtype)),
      ("deepseek-v3-671b", f"as GQA: {v3.num_layers} layers x 2 x {v3.num_heads} heads x {m.v_head_dim}",
       v3.num_layers, kv_cache.bytes_per_token(v3.model_copy(update={"head_dim": m.v_head_dim}), dtype)),
      ("llama3-8b", f"GQA: {llama.num_layers} layers x 2 x {llama.num_kv_heads} kv heads x {llama.head_dim}",
       llama.num_layers, kv_cache.bytes_per_token(llama, dtype)),
  ]


def print_deepseek_kv_cache():
  rows = deepseek_kv_cache_bytes()
  latent = rows[0][3] / rows[0][2]
  print("KV-cache bytes per token (bf16)\n")
  header = f"{'model':<18} {'layout':<48} {'all layers':>11} {'per layer':>10} {'x latent/layer':>15}"
  print(header + "\n" + "-" * len(header))
  for model, layout, layers, nbytes in rows:
    print(f"{model:<18} {layout:<48} {nbytes:>11,} {nbytes // layers:>10,} {nbytes / layers / latent:>15.2f}")


def deepseek_v3_layer_on_v5p(slots: int = 8, context: int = 4096, page: int = 128):
  """Compile one real-width DeepSeek-V3 MoE layer (256 experts over mesh.expert=8) for a
  v5p-16: the train step, then the decode step over a latent cache of `slots` x `context`
  tokens, whose bytes per device must equal layers x slots x context x 576 x 2 (bf16)."""
  from jaxpar.aot.compile import compile_for_topology
  from jaxpar.aot.inference import compile_inference
  config = load_config("deepseek-v3-671b", ["model.num_layers=1", "model.first_dense_layers=0", "model.mtp_depth=0",
                                            "mesh.expert=8", "mesh.topology=v5p-16", "data.seq_len=1024",
                                            "data.global_batch_size=8"])
  report, compiled = compile_for_topology(config, "v5p-16")
  print(f"train step: compiled for {report['devices']} v5p chips, mesh {report['mesh']}, "
        f"{compiled.as_text().count('all-to-all')} all-to-all ops, fits: {report['fits']}")
  served = compile_inference(config, "v5p-16", slots=slots, context=context, page_size=page, chunk=None)
  by_hand = 1 * slots * (context // page) * page * (config.model.mla.latent_dim) * 2
  decode = served["programs"]["decode"]
  print(f"decode step: {decode['pallas_calls']} Pallas calls; cache {served['cache_bytes']:,} bytes per device, "
        f"by hand {by_hand:,} (1 layer x {slots} x {context} tokens x 576 x 2 bytes)")
  assert served["cache_bytes"] == by_hand and decode["pallas_calls"] >= 1


TINY = ("tiny", "tiny-gemma2", "tiny-gemma3", "tiny-deepseek", "tiny-gpt-oss")


def print_tiny_throughput(names=TINY, steps: int = 5, batch: int = 8, prompt: int = 64, new: int = 64):
  import jax
  from decode import jaxpar_times
  from train_throughput import time_steps
  from jaxpar.train.trainer import Trainer
  print(f"Tiny configs on 1 CPU device (float32): training and decode ({batch} x {prompt} prompt, {new} new)\n")
  header = f"{'config':<14} {'params':>10} {'train tokens/s':>15} {'decode tokens/s':>16}"
  print(header + "\n" + "-" * len(header))
  for name in names:
    config = load_config(name, ["mesh.fsdp=1", "checkpoint.enabled=false", "train.log_every=0"])
    trainer = Trainer(config, jax.devices()[:1])
    train = config.data.global_batch_size * config.data.seq_len / time_steps(trainer, steps)
    prompts = np.random.default_rng(0).integers(0, 256, (batch, prompt)).tolist()
    first, whole = jaxpar_times(config.model, batch, prompts, new, repeats=2)
    print(f"{name:<14} {trainer.num_params:>10,} {train:>15,.0f} {batch * (new - 1) / (whole - first):>16,.0f}")


def train_on_their_slices():
  """Compile each shipped config of the newer families (local/global, hybrid linear) at full
  depth for its own slice."""
  from jaxpar.aot.compile import compile_for_topology
  print("Train step at real size, compiled for the slice each config names (per-chip HBM)\n")
  header = (f"{'config':<12} {'slice':<8} {'layers':>6} {'params':>8} {'HBM/chip':>9} {'of':>6} {'fits':>5} "
            f"{'compile':>8}")
  print(header + "\n" + "-" * len(header))
  for name in (n for n in ("gemma3-12b", "gemma4-31b", "gpt-oss-20b", "qwen3.5-35b-a3b") if n in shipped_configs()):
    config = load_config(name)
    report, _ = compile_for_topology(config, config.mesh.topology)
    hbm = f"{report['memory']['total'] / 2**30:.1f} GiB" if "memory" in report else "OOM"
    print(f"{name:<12} {config.mesh.topology:<8} {report['num_layers']:>6} {report['params'] / 1e9:>7.2f}B "
          f"{hbm:>9} {report['hbm_bytes'] / 2**30:>2.0f} GiB {str(report['fits']):>5} "
          f"{report['compile_s']:>7.0f}s", flush=True)


if __name__ == "__main__":
  print_local_global_kv_cache()
  print()
  print_deepseek_kv_cache()
  if "--v5p" in sys.argv:
    print()
    deepseek_v3_layer_on_v5p()
  if "--tiny" in sys.argv:
    print()
    print_tiny_throughput([a for a in sys.argv[sys.argv.index("--tiny") + 1:] if not a.startswith("--")] or TINY)
  if "--v6e" in sys.argv:
    print()
    train_on_their_slices()
  if "--linear" in sys.argv:
    import linear_attention
    print()
    linear_attention.main()
