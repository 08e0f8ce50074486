"""Data pipeline: tokenizers, sources, packing, the resumable sharded batch iterator."""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several CPU devices for the sharding test when this file runs alone; the test adapts to
# whatever count an earlier import already fixed.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxpar.config import DataConfig  # noqa: E402
from jaxpar.data import (  # noqa: E402
  TrainBatches, load_tokenizer, make_example, pack_documents, read_documents,
)
from jaxpar.data.loader import rows_held_by  # noqa: E402

BYTE = load_tokenizer("byte")


def _write_txt(path, docs):
  path.write_text("\n\f\n".join(docs), encoding="utf-8")
  return str(path)


def _small_corpus(tmp_path, n_docs=30):
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "épée", "naïve", "über", "日本"]
  docs = [" ".join(rng.choice(words, size=rng.integers(2, 12))) for _ in range(n_docs)]
  return _write_txt(tmp_path / "small.txt", docs), docs


def _cfg(**kw):
  return DataConfig(**{"source": "bundled", "seq_len": 64, "global_batch_size": 4, **kw})


# -- tokenizers ---------------------------------------------------------------------


def test_byte_tokenizer_roundtrips_unicode():
  text = "Hello, wörld! Ça va? 日本語のテキスト 🎉\nsecond line"
  ids = BYTE.encode(text)
  assert isinstance(ids, list) and len(ids) == len(text.encode("utf-8"))
  assert all(0 <= i < 256 for i in ids)
  assert BYTE.decode(ids) == text
  assert 256 <= BYTE.eos_id < BYTE.vocab_size
  # Special ids decode to nothing, so eos in generated text is harmless.
  assert BYTE.decode(ids[:5] + [BYTE.eos_id] + ids[5:]) == text


def _train_hf_tokenizer(path, special_tokens=("<|endoftext|>",)):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=list(special_tokens),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(
    ["the quick brown fox jumps over the lazy dog", "the dog sleeps", "a fox runs"] * 20,
    trainer,
  )
  tok.save(str(path))
  return tok


def test_hf_tokenizer_json_loads_and_roundtrips(tmp_path):
  raw = _train_hf_tokenizer(tmp_path / "tokenizer.json")
  tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
  assert tok.eos_id == raw.token_to_id("<|endoftext|>")
  assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
  text = "the lazy fox sleeps; naïve über-dog 🎉"
  ids = tok.encode(text)
  assert tok.eos_id not in ids  # packing adds eos, the tokenizer must not
  assert tok.decode(ids) == text
  # A folder holding tokenizer.json works too.
  assert load_tokenizer(str(tmp_path)).encode(text) == ids


def test_hf_tokenizer_without_eos_is_a_clear_error(tmp_path):
  _train_hf_tokenizer(tmp_path / "tokenizer.json", special_tokens=("[UNK]",))
  with pytest.raises(ValueError, match="no end-of-text token"):
    load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_missing_tokenizer_file_names_path_and_fix(tmp_path):
  missing = str(tmp_path / "nope" / "tokenizer.json")
  with pytest.raises(ValueError) as e:
    load_tokenizer(missing)
  msg = str(e.value)
  assert missing in msg and "'byte'" in msg and "\n" not in msg


# -- sources ------------------------------------------------------------------------


def test_sources_txt_jsonl_folder_and_errors(tmp_path):
  _write_txt(tmp_path / "a.txt", ["doc one\n\nstill one", "doc two"])
  rows = [{"text": "doc three", "id": 1}, {"text": "doc four", "id": 2}]
  (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  assert read_documents(str(tmp_path / "a.txt")) == ["doc one\n\nstill one", "doc two"]
  assert read_documents(str(tmp_path / "b.jsonl")) == ["doc three", "doc four"]
  assert read_documents(str(tmp_path)) == [
    "doc one\n\nstill one", "doc two", "doc three", "doc four",
  ]
  with pytest.raises(ValueError, match="no field 'body'"):
    read_documents(str(tmp_path / "b.jsonl"), text_key="body")
  with pytest.raises(ValueError, match="no file or folder at"):
    read_documents(str(tmp_path / "missing.txt"))
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="has no"):
    read_documents(str(tmp_path / "empty"))


def test_bundled_corpus_is_real_prose_and_packs():
  docs = read_documents("bundled")
  assert len(docs) == 166
  assert docs[0].startswith("Pride and Prejudice\n\nChapter 1\n\nIt is a truth universally")
  stream = pack_documents(docs, BYTE)  # its speed: benchmarks/data.py
  assert stream.num_tokens == sum(len(d.encode()) for d in docs) + len(docs)
  # The default config's eval set: chapters of a novel the corpus leaves out.
  heldout = read_documents("bundled-heldout")
  assert len(heldout) == 6 and all(d.startswith("Emma\n\nCHAPTER ") for d in heldout)
  assert not any(d.startswith("Emma") for d in docs)


# -- packing ------------------------------------------------------------------------


def test_packing_hand_made_windows():
  # a b E | c d e E | f g E | h E  (E = eos)
  stream = pack_documents(["ab", "cde", "fg", "h"], BYTE)
  e = BYTE.eos_id
  a, b, c, d, ee, f, g, h = (ord(x) for x in "abcdefgh")
  assert stream.tokens.tolist() == [a, b, e, c, d, ee, e, f, g, e, h, e]
  assert stream.num_windows(5) == 2  # (12 - 1) // 5
  w0, w1 = stream.window(0, 5), stream.window(1, 5)
  assert w0["inputs"].tolist() == [a, b, e, c, d]
  assert w0["targets"].tolist() == [b, e, c, d, ee]
  assert w0["segment_ids"].tolist() == [1, 1, 1, 2, 2]
  assert w0["positions"].tolist() == [0, 1, 2, 0, 1]
  assert w0["loss_mask"].tolist() == [1, 1, 0, 1, 1]
  # Window 1 starts at token 5: shares one token with window 0, mid-document.
  assert w1["inputs"].tolist() == [ee, e, f, g, e]
  assert w1["targets"].tolist() == [e, f, g, e, h]
  assert w1["segment_ids"].tolist() == [1, 1, 2, 2, 2]
  assert w1["positions"].tolist() == [0, 1, 0, 1, 2]
  assert w1["loss_mask"].tolist() == [1, 0, 1, 1, 0]
  assert {k: v.dtype for k, v in w1.items()} == {
    "inputs": np.int32, "targets": np.int32, "segment_ids": np.int32,
    "positions": np.int32, "loss_mask": np.float32,
  }


def test_packing_invariants_random_corpus(tmp_path):
  _, docs = _small_corpus(tmp_path, n_docs=40)
  stream = pack_documents(docs, BYTE)
  eos = BYTE.eos_id
  for seq_len in (7, 16, 33):
    for i in range(stream.num_windows(seq_len)):
      w = stream.window(i, seq_len)
      x, y = w["inputs"], w["targets"]
      np.testing.assert_array_equal(x, stream.tokens[i * seq_len:(i + 1) * seq_len])
      np.testing.assert_array_equal(x[1:], y[:-1])
      # Documents hold no eos, so a boundary is exactly "the input is eos".
      at_boundary = x == eos
      np.testing.assert_array_equal(w["loss_mask"] == 0, at_boundary)
      new_seg = np.concatenate([[False], at_boundary[:-1]])
      np.testing.assert_array_equal(np.diff(w["segment_ids"]), new_seg[1:].astype(int))
      assert w["segment_ids"][0] == 1
      np.testing.assert_array_equal(w["positions"][1:] == 0, new_seg[1:])
      # Inside a segment positions count up by one.
      same = ~new_seg[1:]
      np.testing.assert_array_equal(np.diff(w["positions"])[same], 1)


def test_make_example_matches_window():
  toks = np.array([5, 6, 7, 8], np.int32)
  ex = make_example(toks, np.array([3, 3, 4, 4]))
  assert ex["segment_ids"].tolist() == [1, 1, 2]
  assert ex["positions"].tolist() == [0, 1, 0]
  assert ex["loss_mask"].tolist() == [1.0, 0.0, 1.0]


# -- the iterator -------------------------------------------------------------------


def _take(it, n):
  return [{k: np.asarray(v) for k, v in next(it).items()} for _ in range(n)]


def _same(a, b):
  return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_batches_deterministic_by_seed():
  a = _take(TrainBatches(_cfg(shuffle_seed=1), BYTE), 3)
  b = _take(TrainBatches(_cfg(shuffle_seed=1), BYTE), 3)
  c = _take(TrainBatches(_cfg(shuffle_seed=2), BYTE), 3)
  assert _same(a, b)
  assert not _same(a, c)
  assert a[0]["inputs"].shape == (4, 64) and a[0]["inputs"].dtype == np.int32
  assert a[0]["loss_mask"].dtype == np.float32
  # Shuffled: consecutive rows are not consecutive windows of the stream.
  assert not np.array_equal(a[0]["inputs"][0, 1:], a[0]["inputs"][1, :-1])


def test_one_epoch_sees_every_window_once(tmp_path):
  path, _ = _small_corpus(tmp_path, n_docs=60)
  it = TrainBatches(_cfg(source=path, seq_len=16, global_batch_size=4), BYTE)
  n = it.windows_per_epoch
  steps = n // 4
  seen = [tuple(r) for b in _take(it, steps) for r in b["inputs"]]
  every = {tuple(it.stream.window(i, 16)["inputs"]) for i in range(n)}
  assert len(set(seen)) == len(seen) == steps * 4
  assert set(seen) <= every
  assert it.epoch == pytest.approx(steps * 4 / n)


def test_resume_from_state_gives_same_batches():
  it = TrainBatches(_cfg(shuffle_seed=7), BYTE)
  _take(it, 3)
  state = it.get_state()
  assert json.loads(json.dumps(state)) == state  # small and serialisable
  want = _take(it, 2)
  fresh = TrainBatches(_cfg(shuffle_seed=7), BYTE)
  assert not _same(_take(TrainBatches(_cfg(shuffle_seed=7), BYTE), 2), want)
  fresh.set_state({k: np.int64(v) for k, v in state.items()})  # as orbax may return it
  assert _same(_take(fresh, 2), want)


def test_each_process_loads_its_own_rows(monkeypatch):
  full = _take(TrainBatches(_cfg(global_batch_size=6), BYTE), 2)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  part = _take(TrainBatches(_cfg(global_batch_size=6), BYTE), 2)
  for f, p in zip(full, part):
    for k in f:
      np.testing.assert_array_equal(p[k], f[k][3:])
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  with pytest.raises(ValueError, match="global_batch_size=6 does not divide over 4"):
    TrainBatches(_cfg(global_batch_size=6), BYTE)


def test_too_small_corpus_is_a_clear_error(tmp_path):
  path = _write_txt(tmp_path / "tiny.txt", ["just a few words", "and a few more"])
  with pytest.raises(ValueError) as e:
    TrainBatches(_cfg(source=path, seq_len=16, global_batch_size=8), BYTE)
  msg = str(e.value)
  assert path in msg and "seq_len=16" in msg and "global_batch_size=8" in msg


def test_jsonl_source_with_hf_tokenizer(tmp_path):
  _train_hf_tokenizer(tmp_path / "tokenizer.json")
  rows = [{"body": f"the quick fox {i} jumps over the lazy dog"} for i in range(40)]
  src = tmp_path / "d.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in rows))
  cfg = _cfg(source=str(src), text_key="body", tokenizer=str(tmp_path / "tokenizer.json"),
             seq_len=8, global_batch_size=4)
  it = TrainBatches(cfg)  # tokenizer loaded from the config
  batch = next(it)
  assert it.tokenizer.eos_id in batch["inputs"] or it.tokenizer.eos_id in batch["targets"]
  assert int(batch["inputs"].max()) < it.tokenizer.vocab_size
  assert "the" in it.tokenizer.decode(batch["inputs"].reshape(-1))


def test_sharded_global_batch():
  n = len(jax.devices())
  shape = (2, n // 2) if n >= 2 and n % 2 == 0 else (1, n)
  mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp"))
  sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
  cfg = _cfg(global_batch_size=2 * n, seq_len=32, shuffle_seed=3)
  batch = next(TrainBatches(cfg, BYTE, sharding))
  host = next(TrainBatches(cfg, BYTE))
  for k, v in batch.items():
    assert isinstance(v, jax.Array)
    assert v.shape == (2 * n, 32)
    assert v.sharding == sharding
    assert v.dtype == (np.float32 if k == "loss_mask" else np.int32)
    assert {s.data.shape for s in v.addressable_shards} == {(2, 32)}
    np.testing.assert_array_equal(np.asarray(v), host[k])
  if n > 1:  # an odd batch cannot split over an even number of devices
    with pytest.raises(ValueError, match="does not fit sharding"):
      TrainBatches(_cfg(global_batch_size=2 * n + 1), BYTE, sharding)


# Mesh layouts (data, fsdp, tensor) over 8 devices; a process owns a contiguous block of
# device ids, as JAX numbers them across processes.
LAYOUTS = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (2, 2, 2), (1, 4, 2), (1, 2, 4), (1, 1, 8)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "data%d_fsdp%d_tensor%d" % l)
def test_processes_load_disjoint_rows_that_make_the_single_process_batch(layout):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 simulated devices (the suite's conftest sets them)")
  devices = jax.devices()[:8]
  mesh = Mesh(np.array(devices).reshape(layout), ("data", "fsdp", "tensor"))
  sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
  batch_shards = layout[0] * layout[1]
  cfg = _cfg(global_batch_size=16, seq_len=16, shuffle_seed=5)
  single = TrainBatches(cfg, BYTE)
  single.set_state({"next_sample": 48})  # mid-run: the position is global, not per process
  want = next(single)
  for processes in (1, 2, 4, 8):
    per = 8 // processes
    rows = [rows_held_by(sharding, devices[p * per:(p + 1) * per], 16, 16) for p in range(processes)]
    assert sorted(set(np.concatenate(rows).tolist())) == list(range(16))
    for a in range(processes):
      for b in range(a + 1, processes):
        shared = set(rows[a].tolist()) & set(rows[b].tolist())
        # Disjoint, unless the two hold the same batch shards (tensor axis across processes).
        assert not shared or np.array_equal(rows[a], rows[b]), (a, b, rows)
        if processes <= batch_shards:
          assert not shared, (a, b, rows)
    for p in range(processes):  # each process's own loader, started from the same global position
      loader = TrainBatches(cfg, BYTE)
      loader.set_state({"next_sample": 48})
      got = loader.local_batch(48, rows[p])
      for key in want:
        np.testing.assert_array_equal(got[key], want[key][rows[p]])
