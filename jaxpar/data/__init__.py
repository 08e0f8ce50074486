"""Data pipeline: sources (files, folders, globs, `datasets` folders, token caches) -> tokens ->
packed windows -> sharded global batches, mixed by weight; eval sets held out by document."""

from jaxpar.data.cache import open_cache, write_cache
from jaxpar.data.loader import EvalBatches, TrainBatches
from jaxpar.data.mixture import Source, eval_streams, load_stream, open_sources
from jaxpar.data.packing import PackedStream, make_example, pack_documents
from jaxpar.data.readers import Column
from jaxpar.data.sources import bundled_path, read_documents, source_files
from jaxpar.data.token_bytes import byte_lengths
from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, copy_tokenizer_files, load_tokenizer

__all__ = [
  "ByteTokenizer", "Column", "EvalBatches", "HFTokenizer", "PackedStream", "Source", "TrainBatches",
  "bundled_path", "byte_lengths", "copy_tokenizer_files", "eval_streams", "load_stream", "load_tokenizer",
  "make_example", "open_cache", "open_sources", "pack_documents", "read_documents", "source_files",
  "write_cache",
]
