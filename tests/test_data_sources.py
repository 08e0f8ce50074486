"""Data sources and the token cache: every format round-trips the same documents, bad files
get one-line errors naming them, and the cache equals tokenizing on the fly, resumably."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import zstandard

from jaxpar.config import DataConfig
from jaxpar.data import (Column, TrainBatches, load_stream, load_tokenizer, open_cache, pack_documents,
                         read_documents, write_cache)
from jaxpar.data import cache as cache_module
from jaxpar.data.readers import read_file
from jaxpar.errors import DataError
from tests.test_data import _train_hf_tokenizer

DOCS = [f"document {i}: naïve café {'über ' * (i % 5)}日本 🎉\n\nsecond paragraph {i}" for i in range(40)]
TOKENS = [np.arange(i % 7 + 1, dtype=np.int32) + i for i in range(40)]
BYTE = load_tokenizer("byte")


def _jsonl(rows) -> bytes:
  return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _arrow_file(path, table):
  with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
    writer.write_table(table)


def _arrow_stream(path, table):
  with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
    writer.write_table(table, max_chunksize=7)  # several record batches


def _write(kind, tmp_path, docs, key="text"):
  """`docs` written as `kind`; returns the source path to read back."""
  table = pa.table({key: docs, "id": list(range(len(docs)))})
  rows = [{key: d if isinstance(d, str) else d.tolist(), "id": i} for i, d in enumerate(docs)]
  half = len(docs) // 2
  if kind == "txt":
    (tmp_path / "c.txt").write_text("\f".join(docs))
  elif kind == "txt.gz":
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress("\f".join(docs).encode()))
  elif kind == "txt.zst":
    (tmp_path / "c.txt.zst").write_bytes(zstandard.ZstdCompressor().compress("\f".join(docs).encode()))
  elif kind == "jsonl":
    (tmp_path / "c.jsonl").write_bytes(_jsonl(rows))
  elif kind == "jsonl.gz":
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(_jsonl(rows)))
  elif kind == "jsonl.zst":
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(rows)))
  elif kind == "parquet":
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=9)
  elif kind == "arrow":
    _arrow_file(tmp_path / "c.arrow", table)
  elif kind == "arrow-stream":
    _arrow_stream(tmp_path / "c.arrow", table)
  elif kind == "feather":
    feather.write_feather(table, tmp_path / "c.feather")
  elif kind == "parquet-folder":  # shards in a nested folder, read in sorted order
    (tmp_path / "c" / "part").mkdir(parents=True)
    pq.write_table(table.slice(0, half), tmp_path / "c" / "part" / "00.parquet")
    pq.write_table(table.slice(half), tmp_path / "c" / "part" / "01.parquet")
    return str(tmp_path / "c")
  elif kind == "jsonl-glob":
    (tmp_path / "shard-0.jsonl.gz").write_bytes(gzip.compress(_jsonl(rows[:half])))
    (tmp_path / "shard-1.jsonl").write_bytes(_jsonl(rows[half:]))
    (tmp_path / "other.parquet").write_bytes(b"not matched by the glob")
    return str(tmp_path / "shard-*")
  elif kind == "save_to_disk":
    import datasets
    datasets.Dataset.from_dict({key: [r[key] for r in rows]}).save_to_disk(tmp_path / "c", num_shards=2)
    return str(tmp_path / "c")
  elif kind == "datasetdict":
    import datasets
    train = datasets.Dataset.from_dict({key: [r[key] for r in rows]})
    datasets.DatasetDict({"test": train.select([0]), "train": train}).save_to_disk(tmp_path / "c")
    return str(tmp_path / "c")
  elif kind == "load_dataset-cache":  # the Arrow files `load_dataset` writes for local files
    import datasets
    (tmp_path / "raw.jsonl").write_bytes(_jsonl(rows))
    datasets.load_dataset("json", data_files=str(tmp_path / "raw.jsonl"), cache_dir=str(tmp_path / "hf"))
    return str(tmp_path / "hf" / "json")
  return str(next(p for p in tmp_path.iterdir() if p.name.startswith("c.")))


TEXT_KINDS = ["txt", "txt.gz", "txt.zst", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow", "arrow-stream",
              "feather", "parquet-folder", "jsonl-glob", "save_to_disk", "datasetdict", "load_dataset-cache"]


@pytest.mark.parametrize("kind", TEXT_KINDS)
def test_every_source_kind_round_trips_the_documents(kind, tmp_path):
  assert read_documents(_write(kind, tmp_path, DOCS)) == DOCS


@pytest.mark.parametrize("kind", ["jsonl.zst", "parquet", "arrow-stream", "save_to_disk"])
def test_pre_tokenized_columns_round_trip(kind, tmp_path):
  got = read_documents(_write(kind, tmp_path, TOKENS, key="input_ids"), tokens_key="input_ids")
  assert len(got) == len(TOKENS) and all(np.array_equal(a, b) for a, b in zip(got, TOKENS))
  # Packed with eos after each document and no tokenizer work.
  stream = load_stream(_write(kind, tmp_path, TOKENS, key="input_ids"), BYTE, tokens_key="input_ids")
  np.testing.assert_array_equal(stream.tokens, np.concatenate([np.append(t, BYTE.eos_id) for t in TOKENS]))


def _one_line_error(source, *needles, **kwargs):
  with pytest.raises(DataError) as error:
    read_documents(str(source), **kwargs)
  message = str(error.value)
  assert "\n" not in message and all(n in message for n in needles), message
  return message


def test_bad_inputs_get_one_line_errors_naming_the_file(tmp_path):
  pq.write_table(pa.table({"body": ["x"]}), tmp_path / "cols.parquet")
  _one_line_error(tmp_path / "cols.parquet", "cols.parquet", "no column 'text'", "'body'", "data.text_key")
  (tmp_path / "cols.jsonl").write_text('{"body": "x"}\n')
  _one_line_error(tmp_path / "cols.jsonl", "cols.jsonl:1", "no field 'text'")
  (tmp_path / "latin.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
  _one_line_error(tmp_path / "latin.txt", "latin.txt", "byte 3 is not UTF-8")
  (tmp_path / "latin.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
  _one_line_error(tmp_path / "latin.jsonl", "latin.jsonl:2", "not UTF-8")
  pq.write_table(pa.table({"text": pa.array([b"caf\xe9"], pa.binary())}), tmp_path / "binary.parquet")
  _one_line_error(tmp_path / "binary.parquet", "binary.parquet", "not UTF-8")
  pq.write_table(pa.table({"text": DOCS}), tmp_path / "cut.parquet")
  data = (tmp_path / "cut.parquet").read_bytes()
  (tmp_path / "cut.parquet").write_bytes(data[:-12] + b"\0" * 12)  # the footer's length and magic
  _one_line_error(tmp_path / "cut.parquet", "cut.parquet", "not a readable Parquet file")
  (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(_jsonl([{"text": d} for d in DOCS]))[:-40])
  _one_line_error(tmp_path / "cut.jsonl.gz", "cut.jsonl.gz", "cannot decompress")
  (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
  _one_line_error(tmp_path / "bad.jsonl", "bad.jsonl:2", "not valid JSON")
  _one_line_error(tmp_path / "nothing-*.parquet", "nothing-*.parquet", "matches no")
  pq.write_table(pa.table({"ids": pa.array([["a"]])}), tmp_path / "strings.parquet")
  _one_line_error(tmp_path / "strings.parquet", "strings.parquet", "not lists of integer token ids",
                  tokens_key="ids")


def test_empty_files_and_documents_are_skipped_and_counted(tmp_path):
  (tmp_path / "a.jsonl").write_text("")
  (tmp_path / "b.jsonl").write_bytes(_jsonl([{"text": "kept"}, {"text": "  "}, {"text": None}]))
  skipped = __import__("collections").Counter()
  docs = [d for f in ("a.jsonl", "b.jsonl") for batch in read_file(str(tmp_path / f), Column(), skipped)
          for d in batch]
  assert docs == ["kept"] and skipped == {"empty files": 1, "empty documents": 2}
  (tmp_path / "only").mkdir()
  (tmp_path / "only" / "empty.parquet").write_bytes(b"")
  _one_line_error(tmp_path / "only", "empty.parquet", "not a readable Parquet file")
  (tmp_path / "blank").mkdir()
  (tmp_path / "blank" / "x.txt").write_text("\n\f\n")
  _one_line_error(tmp_path / "blank", "holds no non-empty documents")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  _train_hf_tokenizer(path)
  return load_tokenizer(str(path))


def test_token_cache_equals_tokenizing_on_the_fly(tmp_path, hf_tokenizer):
  source = _write("parquet-folder", tmp_path, DOCS)
  meta = write_cache(source, tmp_path / "cache", hf_tokenizer, show_progress=False, echo=lambda _: None)
  cached, fresh = open_cache(tmp_path / "cache", hf_tokenizer), pack_documents(DOCS, hf_tokenizer)
  assert meta["documents"] == len(DOCS) and meta["dtype"] == "uint16"
  np.testing.assert_array_equal(cached.tokens, fresh.tokens)
  np.testing.assert_array_equal(cached.starts, fresh.starts)
  assert isinstance(cached.tokens, np.memmap)
  with pytest.raises(DataError, match="another tokenizer"):
    open_cache(tmp_path / "cache", BYTE)


def test_training_reads_the_cache_without_tokenizing(tmp_path, monkeypatch):
  source = _write("jsonl.zst", tmp_path, DOCS * 4)
  write_cache(source, tmp_path / "cache", BYTE, show_progress=False, echo=lambda _: None)
  want = next(TrainBatches(DataConfig(source=source, seq_len=32, global_batch_size=4), BYTE))
  monkeypatch.setattr(type(BYTE), "encode_batch", lambda *a: pytest.fail("tokenized again"))
  got = next(TrainBatches(DataConfig(source=str(tmp_path / "cache"), seq_len=32, global_batch_size=4), BYTE))
  for key in want:
    np.testing.assert_array_equal(got[key], want[key])


def test_interrupted_tokenize_resumes_to_the_same_cache(tmp_path, monkeypatch):
  source = _write("jsonl-glob", tmp_path, DOCS * 3)
  whole = write_cache(source, tmp_path / "whole", BYTE, show_progress=False, echo=lambda _: None)
  monkeypatch.setattr(cache_module, "COMMIT_TOKENS", 500)  # commit often
  calls = {"n": 0}
  real = type(BYTE).encode_batch

  def failing(self, texts):
    calls["n"] += 1
    if calls["n"] == 3:
      raise KeyboardInterrupt  # cut off mid-file
    return real(self, texts)
  monkeypatch.setattr("jaxpar.data.readers.BATCH", 10)
  monkeypatch.setattr(type(BYTE), "encode_batch", failing)
  with pytest.raises(KeyboardInterrupt):
    write_cache(source, tmp_path / "cut", BYTE, show_progress=False, echo=lambda _: None)
  assert not (tmp_path / "cut" / "cache.json").exists()
  with pytest.raises(DataError, match="incomplete"):
    open_cache(tmp_path / "cut")
  ledger = (tmp_path / "cut" / "ledger.jsonl").read_text().splitlines()
  assert len(ledger) >= 2 and json.loads(ledger[-1])["documents"] > 0  # something was committed
  (tmp_path / "cut" / "tokens.bin").open("ab").write(b"\1\2\3")  # a torn write after the last commit
  monkeypatch.setattr(type(BYTE), "encode_batch", real)
  said = []
  resumed = write_cache(source, tmp_path / "cut", BYTE, show_progress=False, echo=said.append)
  assert said[0].startswith("resuming") and resumed["tokens"] == whole["tokens"]
  a, b = open_cache(tmp_path / "cut"), open_cache(tmp_path / "whole")
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.starts, b.starts)
  with pytest.raises(DataError, match="started for another source"):
    (tmp_path / "cut" / "cache.json").unlink()
    write_cache(str(tmp_path / "shard-0.jsonl.gz"), tmp_path / "cut", BYTE, show_progress=False)
