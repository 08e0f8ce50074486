"""Where documents come from: a source names the bundled corpus, one file, a folder or a
glob of shards, or a local Hugging Face `datasets` folder.

  bundled               the corpus shipped in the package (bundled-heldout: text it leaves out)
  a file                .txt, .jsonl, .parquet, .arrow, .feather (readers.py; .gz/.zst text)
  a folder              every such file under it, recursively, in sorted order
  a glob                `shards/*.parquet`, `web/**/*.jsonl.zst`: the matching files, sorted
  a `datasets` folder   what `Dataset.save_to_disk` writes (state.json beside .arrow files), or
                        a DatasetDict's (dataset_dict.json): its `train` split

Files are read in sorted order, so every process and every run sees the same documents in
the same order. A token cache (jaxpar/data/cache.py) is a folder too: `open_cache` reads it.
"""

from __future__ import annotations

import collections
import glob
import importlib.resources
import json
import os
from typing import Iterator

from jaxpar.data.readers import Column, file_format, read_file
from jaxpar.errors import DataError

BUNDLED = "bundled"
BUNDLED_CHAT = "bundled-chat"  # the small chat set configs/sft-tiny.yaml fine-tunes on (data.format=chat)
# Arithmetic prompts for reinforcement learning: those the chat set never asks (configs/grpo-tiny.yaml
# learns on them), and those it asks.
# `bundled-heldout`: Emma's first six chapters, a novel the bundled corpus leaves out: the
# default config's eval set (`jaxpar eval runs/tiny`).
BUNDLED_FILES = {BUNDLED: "austen.txt.gz", "bundled-heldout": "austen_heldout.txt.gz", BUNDLED_CHAT: "tiny_chat.jsonl",
                 "bundled-prompts": "tiny_prompts.jsonl", "bundled-prompts-seen": "tiny_prompts_seen.jsonl"}
_KINDS = ".txt, .jsonl, .parquet, .arrow, .feather (text and JSON lines may be .gz or .zst)"


def bundled_path(name: str = "austen.txt.gz") -> str:
  """The path of a file shipped in the package's corpus folder (works for installed wheels too)."""
  res = importlib.resources.files("jaxpar.data") / "corpus" / name
  return os.fspath(res)


def is_glob(spec: str) -> bool:
  return any(c in spec for c in "*?[")


def _hf_dataset_files(folder: str) -> list[str] | None:
  """The Arrow files of a `datasets` save_to_disk folder (a DatasetDict: its train split)."""
  splits = os.path.join(folder, "dataset_dict.json")
  if os.path.isfile(splits):
    with open(splits) as f:
      names = json.load(f).get("splits", [])
    if "train" not in names:
      raise DataError(f"{folder} is a DatasetDict without a 'train' split (has {names}): point at "
                      f"one split's folder, e.g. {os.path.join(folder, names[0]) if names else folder}")
    folder = os.path.join(folder, "train")
  state = os.path.join(folder, "state.json")
  if not os.path.isfile(state):
    return None
  with open(state) as f:
    files = [os.path.join(folder, entry["filename"]) for entry in json.load(f).get("_data_files", [])]
  missing = [p for p in files if not os.path.isfile(p)]
  if missing:
    raise DataError(f"{folder}: state.json lists {missing[0]}, which is missing: the dataset folder "
                    "is incomplete; save it again")
  return files


def source_files(spec: str) -> list[str]:
  """The files of a source, in reading order."""
  if spec in BUNDLED_FILES:
    return [bundled_path(BUNDLED_FILES[spec])]
  path = os.path.expanduser(spec)
  if is_glob(path):
    found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p) and file_format(p))
    if not found:
      raise DataError(f"data source {spec!r} matches no {_KINDS} file: check the pattern")
    return found
  if os.path.isdir(path):
    hf = _hf_dataset_files(path)
    if hf is not None:
      return hf
    found = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                   if file_format(name))
    if not found:
      raise DataError(f"data source: folder {spec!r} has no {_KINDS} files")
    return found
  if not os.path.isfile(path):
    raise DataError(f"data source: no file or folder at {spec!r}; use 'bundled' or a path to {_KINDS} "
                    "files, a folder or a glob of them")
  if not file_format(path):
    raise DataError(f"data source: {spec!r} is not one of {_KINDS}")
  return [path]


def iter_documents(files: list[str], column: Column = Column(),
                   skipped: collections.Counter | None = None) -> Iterator[list]:
  """Batches of documents from `files`, in order (see readers.read_file)."""
  for path in files:
    yield from read_file(path, column, skipped)


def read_documents(source: str, text_key: str = "text", tokens_key: str | None = None) -> list:
  """Every non-empty document of `source` (str, or int32 arrays for a token column), in a fixed order."""
  column = Column(tokens_key, tokens=True) if tokens_key else Column(text_key)
  docs = [d for batch in iter_documents(source_files(source), column) for d in batch]
  if not docs:
    raise DataError(f"data source {source!r} holds no non-empty documents")
  return docs


def set_name(path: str) -> str:
  """An eval set's name for a path: its file or folder name without suffixes."""
  return os.path.basename(path.rstrip("/")).split(".")[0] or path
