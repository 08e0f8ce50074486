"""Read documents (strings) from the bundled corpus, a .txt/.jsonl file, or a folder of them.

Formats (each may also be gzip-compressed, `.txt.gz` / `.jsonl.gz`):
  .txt    documents separated by a form feed character (\\f); a file without one is one
          document. Blank lines stay inside documents, so paragraphs survive.
  .jsonl  one JSON object per line; the document is the field `text_key`.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os

from jaxpar.errors import DataError

BUNDLED = "bundled"
_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz")


def bundled_path() -> str:
  """The path of the corpus shipped inside the package (works for installed wheels too)."""
  res = importlib.resources.files("jaxpar.data") / "corpus" / "austen.txt.gz"
  return os.fspath(res)


def _open_text(path: str):
  if path.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8")
  return open(path, encoding="utf-8")


def _read_txt(path: str) -> list[str]:
  with _open_text(path) as f:
    text = f.read()
  return [d.strip("\n") for d in text.split("\f")]


def _read_jsonl(path: str, text_key: str) -> list[str]:
  docs = []
  with _open_text(path) as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
      if not isinstance(row, dict) or text_key not in row:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataError(
          f"{path}:{lineno}: no field {text_key!r} (has {keys}); set data.text_key"
        )
      docs.append(str(row[text_key]))
  return docs


def _files(path: str) -> list[str]:
  if os.path.isdir(path):
    # Sorted, so every process and every run sees the same document order.
    found = sorted(
      os.path.join(root, name)
      for root, _, names in os.walk(path)
      for name in names
      if name.endswith(_SUFFIXES)
    )
    if not found:
      raise DataError(
        f"data.source: folder {path!r} has no {', '.join(_SUFFIXES)} files"
      )
    return found
  if not os.path.isfile(path):
    raise DataError(
      f"data.source: no file or folder at {path!r}; use 'bundled' or a path to "
      f"{', '.join(_SUFFIXES)} files"
    )
  if not path.endswith(_SUFFIXES):
    raise DataError(
      f"data.source: {path!r} is not one of {', '.join(_SUFFIXES)}"
    )
  return [path]


def read_documents(source: str, text_key: str = "text") -> list[str]:
  """All non-empty documents of `source`, in a fixed order."""
  if source == BUNDLED:
    paths = [bundled_path()]
  else:
    paths = _files(os.path.expanduser(source))
  docs = []
  for p in paths:
    part = _read_jsonl(p, text_key) if ".jsonl" in os.path.basename(p) else _read_txt(p)
    docs.extend(d for d in part if d.strip())
  if not docs:
    raise DataError(f"data.source: {source!r} holds no non-empty documents")
  return docs
