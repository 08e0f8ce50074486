"""Model families at real size: KV-cache bytes per token of the shipped configs.

Local/global part (Gemma 2, Gemma 3; GPT-OSS when its config ships): a layer with a
sliding window never reads keys further back than its window, so over a long sequence its
cache costs window / seq_len of a global layer's per token. The table gives, per model,
the bytes one token adds to every layer's cache, the cache a `seq_len`-token sequence
needs when sliding layers keep only their window, that over seq_len (the effective bytes
per token), and both against Llama 3 8B. "Engine holds" is what jaxpar's paged engine
keeps today: it frees pages before the window only when every layer slides, so a model
that mixes local and global layers holds every layer's pages for the whole sequence.

    python benchmarks/families.py
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from jaxpar.config import load_config, shipped_configs  # noqa: E402
from jaxpar.models import kv_reach, layer_options  # noqa: E402

LOCAL_GLOBAL = ("gemma2-9b", "gemma3-12b", "gpt-oss-20b")


def local_global_kv_cache_bytes(seq_len: int = 32768, dtype: str = "bfloat16") -> list[dict]:
  """One row per shipped model (and llama3-8b, the baseline) with its cache bytes."""
  rows = []
  for name in ("llama3-8b",) + tuple(n for n in LOCAL_GLOBAL if n in shipped_configs()):
    m = load_config(name).model
    per_layer = 2 * m.num_kv_heads * m.head_dim * np.dtype(dtype).itemsize  # keys and values
    windows = [layer_options(m, i).attention.sliding_window for i in range(m.num_layers)]
    kept = [seq_len if w is None else min(w, seq_len) for w in windows]
    held = seq_len * m.num_layers if kv_reach(m) is None else sum(kept)
    rows.append(dict(model=name, local=sum(w is not None for w in windows),
                     glob=sum(w is None for w in windows), per_token=per_layer * m.num_layers,
                     windowed=per_layer * sum(kept), held=per_layer * held))
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
    print(f"{r['model']:<12} {r['local']:>5}/{r['glob']:<6} {r['per_token']:>10,} {r['windowed'] / 2**20:>11,.0f} MiB "
          f"{effective:>10,.0f} {effective / base:>12.2f} {r['held'] / 2**20:>9,.0f} MiB")


if __name__ == "__main__":
  print_local_global_kv_cache()
