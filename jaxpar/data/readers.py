"""Read the documents of one file, in batches, in a fixed order.

Formats, by suffix (text and JSON lines may also be `.gz` or `.zst` compressed); whole rows
of the row formats (`read_records`) are what chat and preference data are made of:
  .txt              documents separated by a form feed (\\f); a file without one is one document
  .jsonl            one JSON object per line; the document is its field `column`
  .parquet          (pyarrow) the column `column`
  .arrow, .feather  Arrow IPC files or streams (what Feather v2 and Hugging Face `datasets` write)

A column holds text (strings) or, pre-tokenized, lists of token ids (`Column.tokens`).
Documents that are empty or null are skipped and counted (`skipped["empty documents"]`),
and so are files with no document (`skipped["empty files"]`). Anything else that cannot be
read (bytes that are not UTF-8, a missing column, a corrupt Parquet footer, bad JSON) is a
one-line DataError naming the file.
"""

import collections
import gzip
import io
import json
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from jaxpar.errors import DataError

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow"}
COMPRESSIONS = (".gz", ".zst")
BATCH = 1024  # documents per batch handed to the tokenizer


@dataclass(frozen=True)
class Column:
  """Where a file keeps its documents: `name`, holding text or (tokens=True) token-id lists."""
  name: str = "text"
  tokens: bool = False


def file_format(path: str) -> str | None:
  """"txt" | "jsonl" | "parquet" | "arrow" for a readable file name, else None."""
  name = os.path.basename(path)
  for suffix in COMPRESSIONS:
    name = name.removesuffix(suffix)
  fmt = FORMATS.get(os.path.splitext(name)[1])
  compressed = name != os.path.basename(path)
  return None if compressed and fmt not in ("txt", "jsonl") else fmt


def read_file(path: str, column: Column = Column(), skipped: collections.Counter | None = None
              ) -> Iterator[list]:
  """Batches of documents (str, or int32 arrays for a token column) of one file."""
  skipped = skipped if skipped is not None else collections.Counter()
  reader = {"txt": _txt, "jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}[file_format(path)]
  if column.tokens and reader is _txt:
    raise DataError(f"{path}: a .txt file holds text, not the token column {column.name!r}; "
                    "unset data.tokens_key for it")
  found = 0
  for batch in reader(path, column):
    kept = [d for d in batch if d is not None and len(d) and (column.tokens or d.strip())]
    if len(kept) < len(batch):
      skipped["empty documents"] += len(batch) - len(kept)
    found += len(batch)
    if kept:
      yield kept
  if not found:
    skipped["empty files"] += 1


def _open(path: str):
  """A binary file handle, decompressed."""
  if path.endswith(".gz"):
    return gzip.open(path, "rb")
  if path.endswith(".zst"):
    import zstandard
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
  return open(path, "rb")


def _decode(data: bytes, where: str) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{where}: byte {e.start} is not UTF-8 ({e.reason}); convert the file to UTF-8, "
                    "e.g. iconv -f latin1 -t utf-8") from None


def _compressed_read(path: str, f) -> bytes:
  try:
    return f.read()
  except (OSError, EOFError, ValueError) as e:  # gzip / zstandard: truncated or not compressed
    raise DataError(f"{path}: cannot decompress ({str(e).splitlines()[0]})") from None


def _txt(path: str, column: Column):
  with _open(path) as f:
    text = _decode(_compressed_read(path, f), path)
  docs = [d.strip("\n") for d in text.split("\f")] if text.strip() else []
  for start in range(0, len(docs), BATCH):
    yield docs[start:start + BATCH]


def _jsonl_rows(path: str):
  """(line number, object) of every non-blank line."""
  with _open(path) as f:
    try:
      for lineno, raw in enumerate(f, 1):
        line = _decode(raw, f"{path}:{lineno}")
        if line.strip():
          try:
            yield lineno, json.loads(line)
          except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    except (OSError, EOFError) as e:
      raise DataError(f"{path}: cannot decompress ({str(e).splitlines()[0]})") from None


def _jsonl(path: str, column: Column):
  batch = []
  for lineno, row in _jsonl_rows(path):
    if not isinstance(row, dict) or column.name not in row:
      keys = sorted(row) if isinstance(row, dict) else type(row).__name__
      raise DataError(f"{path}:{lineno}: no field {column.name!r} (has {keys}); set data.{_key(column)}")
    batch.append(_tokens(row[column.name], path) if column.tokens else _text(row[column.name]))
    if len(batch) == BATCH:
      yield batch
      batch = []
  if batch:
    yield batch


def _key(column: Column) -> str:
  return "tokens_key" if column.tokens else "text_key"


def _text(value):
  return None if value is None else str(value)


def _tokens(value, path):
  if value is None:
    return None
  try:
    return np.asarray(value, np.int32).reshape(-1)
  except (TypeError, ValueError):
    raise DataError(f"{path}: the token column holds {type(value).__name__} values, not lists of "
                    "integer ids") from None


def _arrow_column(batch, path: str, column: Column) -> list:
  """One record batch's documents."""
  import pyarrow as pa
  names = batch.schema.names
  if column.name not in names:
    raise DataError(f"{path}: no column {column.name!r} (has {names}); set data.{_key(column)}")
  values = batch.column(names.index(column.name))
  kind = values.type
  if column.tokens:
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
      raise DataError(f"{path}: column {column.name!r} is {kind}, not lists of integer token ids")
    flat = values.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    offsets = values.offsets.to_numpy() - values.offsets[0].as_py()
    docs = np.split(flat, offsets[1:-1])
    return [None if not valid else d for d, valid in zip(docs, values.is_valid().to_pylist())]
  if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
    return [None if v is None else _decode(v, f"{path}: column {column.name!r}") for v in values.to_pylist()]
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
    raise DataError(f"{path}: column {column.name!r} is {kind}, not text; set data.text_key to a text "
                    "column, or data.tokens_key for token ids")
  return values.to_pylist()


def _arrow_error(path: str, kind: str, error: Exception) -> DataError:
  first = str(error).splitlines()[0] if str(error) else type(error).__name__
  return DataError(f"{path}: not a readable {kind} file ({first}); it is corrupt or truncated: "
                   "write it again or remove it")


def _parquet_batches(path: str, columns=None):
  """Record batches of a Parquet file (only `columns`, when given and present)."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  try:
    parquet = pq.ParquetFile(path)
    if columns is None or all(c in parquet.schema_arrow.names for c in columns):
      yield from parquet.iter_batches(batch_size=BATCH, columns=columns)
    else:
      yield pa.RecordBatch.from_pylist([], schema=parquet.schema_arrow)
  except (pa.ArrowException, OSError) as e:
    raise _arrow_error(path, "Parquet", e) from None


def _parquet(path: str, column: Column):
  for batch in _parquet_batches(path, [column.name]):
    yield _arrow_column(batch, path, column)


def _arrow_batches(path: str):
  """Record batches of an Arrow IPC file or stream, at most BATCH rows each (one empty batch
  for a file with none)."""
  import pyarrow as pa
  try:
    source = pa.memory_map(path)
    try:
      reader = pa.ipc.open_file(source)
      batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:  # not the file format: the stream format (Hugging Face datasets)
      batches = iter(pa.ipc.open_stream(pa.memory_map(path)))
    empty = True
    for batch in batches:
      empty = False
      for start in range(0, batch.num_rows, BATCH):
        yield batch.slice(start, BATCH)
    if empty:
      yield pa.RecordBatch.from_pylist([])
  except (pa.ArrowException, OSError) as e:
    raise _arrow_error(path, "Arrow", e) from None


def _arrow(path: str, column: Column):
  for batch in _arrow_batches(path):
    yield _arrow_column(batch, path, column) if batch.num_columns else []


def read_records(path: str) -> Iterator[dict]:
  """Every row of one JSON-lines, Parquet or Arrow file as a dict (nested lists and structs as
  lists and dicts): what chat and preference data are made of."""
  fmt = file_format(path)
  if fmt == "jsonl":
    for lineno, row in _jsonl_rows(path):
      if not isinstance(row, dict):
        raise DataError(f"{path}:{lineno}: a row must be a JSON object, not {type(row).__name__}")
      yield row
  elif fmt in ("parquet", "arrow"):
    for batch in _parquet_batches(path) if fmt == "parquet" else _arrow_batches(path):
      yield from batch.to_pylist()
  else:
    raise DataError(f"{path} holds text documents, not rows: give JSON lines, Parquet or Arrow rows")
