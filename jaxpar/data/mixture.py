"""Named data sources, their held-out documents, and how training mixes them.

Each source becomes a packed stream (from its token cache, else tokenized here: every
process tokenizes the whole source, so a corpus beyond a host's memory wants a cache).
A source with `holdout` > 0 loses that fraction of its documents to its eval set, chosen
per document (PackedStream.split), so eval text is never trained on. A source of weight 0
is never trained on at all.

Training mixes the sources of positive weight with Grain: each source's windows are
shuffled and repeated on their own, and `MapDataset.mix` interleaves them in the exact
proportions of the weights. Sample k of the run is a pure function of k, so the state of
the whole mixture is one integer.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import grain

from jaxpar.data.cache import is_cache, open_cache
from jaxpar.data.packing import PackedStream, pack_documents
from jaxpar.data.readers import Column
from jaxpar.data.sources import iter_documents, set_name, source_files
from jaxpar.errors import DataError

_log = logging.getLogger(__name__)


@dataclass
class Source:
  """name, weight (training share); train: the documents training reads; heldout: its eval
  set (None without a holdout)."""
  name: str
  weight: float
  train: PackedStream
  heldout: PackedStream | None = None


def load_stream(path: str, tokenizer, text_key: str = "text", tokens_key: str | None = None) -> PackedStream:
  """One source as a stream: a token cache as it is, anything else read and tokenized."""
  if is_cache(path):
    return open_cache(path, tokenizer)
  column = Column(tokens_key, tokens=True) if tokens_key else Column(text_key)
  skipped = collections.Counter()
  docs = [d for batch in iter_documents(source_files(path), column, skipped) for d in batch]
  if skipped:
    _log.warning("data source %s: skipped %s", path, ", ".join(f"{n} {what}" for what, n in skipped.items()))
  if not docs:
    raise DataError(f"data source {path!r} holds no non-empty documents")
  stream = pack_documents(docs, tokenizer)
  if stream.num_tokens and int(stream.tokens.max()) >= tokenizer.vocab_size:
    raise DataError(f"data source {path!r}: token id {int(stream.tokens.max())} is outside the tokenizer's "
                    f"{tokenizer.vocab_size} ids: its token column was made with another tokenizer")
  return stream


def open_sources(data_config, tokenizer, names=None, seed: int | None = None) -> dict[str, Source]:
  """The config's sources (or just `names`), split into training and held-out documents."""
  seed = data_config.shuffle_seed if seed is None else seed
  sources = {}
  for name, s in data_config.named_sources().items():
    if names is not None and name not in names:
      continue
    stream = load_stream(s.path, tokenizer, s.text_key, s.tokens_key)
    train, heldout = stream.split(s.holdout, seed) if s.holdout else (stream, None)
    if s.holdout and not heldout.num_documents:
      raise DataError(f"data source {name!r}: holdout={s.holdout} of its {stream.num_documents} documents "
                      "holds none out: raise the holdout or add documents")
    sources[name] = Source(name, s.weight, train, heldout)
  return sources


def eval_streams(config, tokenizer, names=None, sources: dict[str, Source] | None = None
                 ) -> dict[str, PackedStream]:
  """The eval sets (Config.eval_sets, or `names`: set names, source names or paths) as streams."""
  named, known = config.data.named_sources(), config.eval_sets()
  if names is None:
    wanted = known
  else:
    wanted = {n: known[n] if n in known else n for n in names if n in known or n in named}
    wanted.update({set_name(n): n for n in names if n not in known and n not in named})
  if sources is None:
    sources = open_sources(config.data, tokenizer, [s for s in wanted.values() if s in named])
  streams = {}
  for name, what in wanted.items():
    if what in named:
      source = sources[what]
      streams[name] = source.heldout if source.heldout is not None else source.train
      if source.weight > 0 and source.heldout is None:
        raise DataError(f"eval set {what!r} is trained on and holds no documents out: set its holdout")
    else:
      d = config.data
      streams[name] = load_stream(what, tokenizer, d.text_key, d.tokens_key)
  return streams


class Mixture:
  """Endless random access over the training windows of the sources of positive weight:
  `dataset[k]` is sample k of the run; `source_of(ks)` says which source each came from."""

  def __init__(self, sources: list[Source], seq_len: int, seed: int):
    self.sources = [s for s in sources if s.weight > 0]
    parts = [grain.MapDataset.source(_Windows(s.train, seq_len)).shuffle(seed=seed + i).repeat()
             for i, s in enumerate(self.sources)]
    weights = [s.weight for s in self.sources]
    single = len(parts) == 1
    self.dataset = parts[0] if single else grain.MapDataset.mix(parts, weights)
    # The same mixing over each source's index alone: which source sample k comes from,
    # without reading it.
    self._labels = None if single else grain.MapDataset.mix(
        [grain.MapDataset.source([i]).repeat() for i in range(len(parts))], weights)

  def source_of(self, samples) -> list[int]:
    return [0 if self._labels is None else self._labels[int(k)] for k in samples]


class _Windows:
  """Random-access source of packed examples for Grain: element i is window i."""

  def __init__(self, stream: PackedStream, seq_len: int):
    self._stream, self._seq_len = stream, seq_len
    self._n = stream.num_windows(seq_len)

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, i: int):
    return self._stream.window(int(i), self._seq_len)
