"""Data pipeline: text documents -> tokens -> packed windows -> sharded global batches."""

from jaxpar.data.loader import TrainBatches
from jaxpar.data.packing import PackedStream, make_example, pack_documents
from jaxpar.data.sources import bundled_path, read_documents
from jaxpar.data.tokenizer import ByteTokenizer, HFTokenizer, copy_tokenizer_files, load_tokenizer

__all__ = [
  "ByteTokenizer", "HFTokenizer", "PackedStream", "TrainBatches", "bundled_path", "copy_tokenizer_files",
  "load_tokenizer", "make_example", "pack_documents", "read_documents",
]
