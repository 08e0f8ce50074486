"""The token cache: a corpus tokenized once (`jaxpar data tokenize`), read by training with
no tokenizer work.

A cache is a folder of memory-mapped ragged arrays, as Levanter keeps its caches:
  tokens.bin     every document's token ids, each followed by eos, back to back
                 (uint16 when the vocabulary fits, else uint32)
  offsets.bin    int64 [documents + 1]: where each document starts, then the end
  ledger.jsonl   what is written so far: a header (source files, tokenizer), then one line per
                 committed chunk (files done, documents and tokens so far)
  cache.json     written last, so its presence means complete: tokenizer, dtype, counts

Why this and not ArrayRecord: training reads windows of the packed stream, i.e. slices
that cross document boundaries. With one flat array a window is one slice of a memory map
(the OS pages in only what a process reads, so each process touches only its own rows);
with one record per document it would be a gather of many records, each decoded. The
format needs nothing but numpy to read, and appending is all that writing does, which makes
resuming a cut-off run a truncation to the last committed chunk.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from jaxpar.data.packing import PackedStream
from jaxpar.data.readers import Column
from jaxpar.data.sources import iter_documents, source_files
from jaxpar.errors import DataError

COMPLETE, LEDGER, TOKENS, OFFSETS = "cache.json", "ledger.jsonl", "tokens.bin", "offsets.bin"
FORMAT = "jaxpar-token-cache/1"
COMMIT_TOKENS = 1 << 22  # commit (fsync + ledger line) at least every 4M tokens, and after each file


def is_cache(path) -> bool:
  path = Path(os.path.expanduser(str(path)))
  return (path / COMPLETE).is_file() or (path / LEDGER).is_file()


def tokenizer_fingerprint(tokenizer) -> dict:
  """What must match between a cache and the tokenizer that trains on it."""
  file = getattr(tokenizer, "path", None)
  digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()[:16] if file else "byte"
  return {"tokenizer": digest, "vocab_size": int(tokenizer.vocab_size), "eos_id": int(tokenizer.eos_id)}


def open_cache(path, tokenizer=None) -> PackedStream:
  """A complete cache as a stream (memory-mapped); with `tokenizer`, check it wrote the cache."""
  path = Path(os.path.expanduser(str(path)))
  if not (path / COMPLETE).is_file():
    raise DataError(f"token cache {path} is incomplete (no {COMPLETE}): run the same `jaxpar data "
                    "tokenize` command again to finish it")
  meta = json.loads((path / COMPLETE).read_text())
  if meta.get("format") != FORMAT:
    raise DataError(f"{path / COMPLETE} is not a {FORMAT} cache (format {meta.get('format')!r})")
  if tokenizer is not None and meta["fingerprint"] != tokenizer_fingerprint(tokenizer):
    raise DataError(f"token cache {path} was written with another tokenizer ({meta['fingerprint']}) than "
                    f"data.tokenizer ({tokenizer_fingerprint(tokenizer)}): tokenize again with this one")
  tokens = np.memmap(path / TOKENS, dtype=meta["dtype"], mode="r", shape=(meta["tokens"],))
  offsets = np.memmap(path / OFFSETS, dtype=np.int64, mode="r", shape=(meta["documents"] + 1,))
  return PackedStream(tokens, offsets)


def _plan(source: str, column: Column, tokenizer) -> dict:
  files = source_files(source)
  return {"kind": "header", "source": source, "column": [column.name, column.tokens],
          "files": [[os.path.abspath(f), os.path.getsize(f)] for f in files],
          "fingerprint": tokenizer_fingerprint(tokenizer)}


def _resume(out: Path, plan: dict) -> dict:
  """The last committed position of an interrupted write (truncating what came after it)."""
  lines = [json.loads(line) for line in (out / LEDGER).read_text().splitlines() if line.strip()]
  if not lines or lines[0] != plan:
    raise DataError(f"{out} holds a token cache started for another source, file set or tokenizer: "
                    "remove it or write to another folder")
  last = lines[-1] if len(lines) > 1 else {"file": 0, "in_file": 0, "documents": 0, "tokens": 0}
  with open(out / TOKENS, "r+b") as f:
    f.truncate(last["tokens"] * np.dtype(_dtype(plan)).itemsize)
  with open(out / OFFSETS, "r+b") as f:
    f.truncate((last["documents"] + 1) * 8)
  return last


def _dtype(plan: dict) -> str:
  return "uint16" if plan["fingerprint"]["vocab_size"] <= 1 << 16 else "uint32"


def write_cache(source: str, out, tokenizer, column: Column = Column(), *, echo=print,
                show_progress: bool = True) -> dict:
  """Tokenize `source` into a cache at `out` (resuming an interrupted write there).
  Returns the cache's metadata (documents, tokens, skipped, tokens_per_s)."""
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
  out = Path(out)
  if (out / COMPLETE).is_file():
    meta = json.loads((out / COMPLETE).read_text())
    echo(f"{out} is already a complete token cache ({meta['documents']:,} documents); nothing to do")
    return meta
  plan = _plan(source, column, tokenizer)
  out.mkdir(parents=True, exist_ok=True)
  if (out / LEDGER).is_file():
    done = _resume(out, plan)
    echo(f"resuming {out} after {done['documents']:,} documents, {done['tokens']:,} tokens")
  else:
    for name in (TOKENS, OFFSETS):
      (out / name).write_bytes(b"")
    np.zeros(1, np.int64).tofile(out / OFFSETS)
    with open(out / LEDGER, "w") as f:
      f.write(json.dumps(plan) + "\n")
    done = {"file": 0, "in_file": 0, "documents": 0, "tokens": 0}
  dtype, files = _dtype(plan), [f for f, _ in plan["files"]]
  skipped, started, new_tokens = collections.Counter(), time.perf_counter(), 0
  progress = Progress(TextColumn("[bold]tokenize"), BarColumn(), MofNCompleteColumn(), TextColumn("files"),
                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(), disable=not show_progress)
  with progress, open(out / TOKENS, "ab") as tokens_file, open(out / OFFSETS, "ab") as offsets_file, \
      open(out / LEDGER, "a") as ledger:
    task = progress.add_task("tokenize", total=len(files), completed=done["file"], status="")
    position = dict(done)
    for index in range(done["file"], len(files)):
      position.update(file=index, in_file=done["in_file"] if index == done["file"] else 0)
      pending = 0
      to_skip = position["in_file"]
      for batch in iter_documents([files[index]], column, skipped):
        batch, to_skip = batch[to_skip:], max(0, to_skip - len(batch))
        if not batch:
          continue
        pieces = batch if column.tokens else tokenizer.encode_batch(batch)
        lengths = np.array([len(p) + 1 for p in pieces], np.int64)
        joined = np.concatenate([x for p in pieces for x in (np.asarray(p), [tokenizer.eos_id])])
        _check_ids(joined, tokenizer.vocab_size, files[index])
        joined.astype(dtype).tofile(tokens_file)
        (position["tokens"] + np.cumsum(lengths)).tofile(offsets_file)
        position["tokens"] += int(lengths.sum())
        position["documents"] += len(pieces)
        position["in_file"] += len(pieces)
        pending += int(lengths.sum())
        new_tokens += int(lengths.sum())
        if pending >= COMMIT_TOKENS:
          _commit(ledger, position, tokens_file, offsets_file)
          pending = 0
        rate = new_tokens / max(time.perf_counter() - started, 1e-9)
        progress.update(task, status=f"{position['documents']:,} documents  {position['tokens']:,} tokens  "
                                     f"{rate:,.0f} tokens/s")
      _commit(ledger, {**position, "file": index + 1, "in_file": 0}, tokens_file, offsets_file)
      progress.update(task, completed=index + 1)
  if not position["documents"]:
    raise DataError(f"data source {source!r} holds no non-empty documents")
  meta = {"format": FORMAT, "source": source, "dtype": dtype, "documents": position["documents"],
          "tokens": position["tokens"], "fingerprint": plan["fingerprint"], "column": plan["column"],
          "files": len(files), "skipped": dict(skipped),
          "tokens_per_s": new_tokens / max(time.perf_counter() - started, 1e-9)}
  (out / COMPLETE).write_text(json.dumps(meta, indent=1) + "\n")
  return meta


def _check_ids(tokens: np.ndarray, vocab_size: int, path: str):
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise DataError(f"{path}: token ids {int(tokens.min())}..{int(tokens.max())} fall outside the "
                    f"tokenizer's {vocab_size} ids: the token column was made with another tokenizer")


def _commit(ledger, position: dict, *files):
  """Make everything written so far durable, then record it: a crash after this line resumes here."""
  for f in files:
    f.flush()
    os.fsync(f.fileno())
  ledger.write(json.dumps({k: position[k] for k in ("file", "in_file", "documents", "tokens")}) + "\n")
  ledger.flush()
  os.fsync(ledger.fileno())
