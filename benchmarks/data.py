"""Data throughput against the train step: tokenizing must never be what a run waits for.

    python benchmarks/data.py [--copies 4] [--batches 50]

The bundled corpus (repeated `--copies` times) is written as a .txt file and a Parquet
file, then, for the byte-level tokenizer and a BPE tokenizer trained here (8k vocabulary):
  tokenize   read + tokenize + pack on the fly (text, parquet), and `jaxpar data tokenize`
             writing a token cache from the parquet file
  load       the training loader (TrainBatches, host batches of `tiny`'s shape: 32 x 128),
             over the in-memory stream of each source and over the memory-mapped cache
Both in tokens/s, beside the train step's tokens/s of `tiny` and `bench-20m` on 1 CPU device.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from jaxpar.config import DataConfig, load_config  # noqa: E402
from jaxpar.data import TrainBatches, load_stream, load_tokenizer, read_documents, write_cache  # noqa: E402
from jaxpar.train.trainer import Trainer  # noqa: E402


def _bpe(folder: Path, docs) -> str:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.save(str(folder / "tokenizer.json"))
  return str(folder / "tokenizer.json")


def _timed(fn):
  start = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - start


def loader_rate(source: str, tokenizer, batches: int) -> float:
  config = DataConfig(source=source, seq_len=128, global_batch_size=32)
  loader = TrainBatches(config, tokenizer)
  next(loader)  # first touch of the pages
  _, seconds = _timed(lambda: [next(loader) for _ in range(batches)])
  return batches * 32 * 128 / seconds


def train_rate(name: str, steps: int = 5) -> float:
  config = load_config(name, ["mesh.fsdp=1", "train.peak_flops_per_device=1e9"])
  trainer = Trainer(config, devices=jax.devices()[:1])
  state, batches = trainer.init_state(), trainer.batches()
  for _ in range(2):  # compile and warm up
    state, metrics = trainer.step(state, next(batches))
  jax.block_until_ready(metrics)
  data = [next(batches) for _ in range(steps)]
  start = time.perf_counter()
  for batch in data:
    state, metrics = trainer.step(state, batch)
  jax.block_until_ready((state, metrics))
  return steps * config.data.global_batch_size * config.data.seq_len / (time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--copies", type=int, default=4, help="times the bundled corpus is repeated")
  parser.add_argument("--batches", type=int, default=50, help="loader batches timed per source")
  args = parser.parse_args()
  folder = Path(tempfile.mkdtemp(prefix="jaxpar-data-bench-"))
  docs = read_documents("bundled") * args.copies
  (folder / "corpus.txt").write_text("\f".join(docs))
  pq.write_table(pa.table({"text": docs}), folder / "corpus.parquet")
  megabytes = sum(len(d.encode()) for d in docs) / 1e6
  print(f"corpus: {len(docs)} documents, {megabytes:.1f} MB of text, in {folder}")
  rows = []
  for label, tokenizer in (("byte", load_tokenizer("byte")), ("bpe-8k", load_tokenizer(_bpe(folder, docs[:200])))):
    for kind in ("txt", "parquet"):
      stream, seconds = _timed(lambda: load_stream(str(folder / f"corpus.{kind}"), tokenizer))
      rows.append((f"tokenize {kind} on the fly", label, stream.num_tokens / seconds))
    cache = folder / f"cache-{label}"
    meta, seconds = _timed(lambda: write_cache(str(folder / "corpus.parquet"), cache, tokenizer,
                                               show_progress=False, echo=lambda _: None))
    rows.append(("tokenize parquet -> cache", label, meta["tokens"] / seconds))
    for kind, source in (("txt", folder / "corpus.txt"), ("parquet", folder / "corpus.parquet"), ("cache", cache)):
      rows.append((f"load {kind} ({'memory map' if kind == 'cache' else 'in memory'})", label,
                   loader_rate(str(source), tokenizer, args.batches)))
  trains = {name: train_rate(name) for name in ("tiny", "bench-20m")}
  print(f"\n{'what':<38} {'tokenizer':<9} {'tokens/s':>12} " + " ".join(f"{'x ' + n:>12}" for n in trains))
  for what, label, rate in rows:
    print(f"{what:<38} {label:<9} {rate:>12,.0f} " + " ".join(f"{rate / t:>12.1f}" for t in trains.values()))
  for name, rate in trains.items():
    print(f"{'train step ' + name + ' (1 CPU device)':<38} {'byte':<9} {rate:>12,.0f}")
  print("\nx NAME: how many times faster than NAME's train step consumes tokens (must stay > 1).")


if __name__ == "__main__":
  main()
