"""The KV cache's page pool: which pages are free, which each sequence holds, and which
hold a prefix another sequence may share.

Host-side bookkeeping only; the pages themselves live on the devices (models/kv_cache.py).
A sequence gets pages as it grows, so memory follows actual lengths, not the maximum.
When every layer attends through a sliding window, the pages wholly before the window of
a sequence's next query are handed back while it goes on (`release_before`): a long
generation then holds about window / page_size + 1 pages.

Prefix caching: a page whose page_size tokens are all written is indexed by the hash of
its tokens and of every token before them (`block_hashes`), so a later sequence that
starts with the same tokens takes the page instead of computing it again. Pages count
their holders; one that nobody holds stays indexed (cached) until its place is needed,
the least recently used first.
"""

import collections
import hashlib

import numpy as np

RELEASED = -1  # the place of a page handed back while its sequence goes on
NARROWEST_TABLE = 512  # positions: the narrowest extra page table decode is compiled for


class PagePool:
  """`cached_yield_to_order`: a sequence grows into the page after its last one even when
  that page holds a cached block nobody holds (the block is evicted out of LRU order), so
  its pages stay consecutive. For CPU decode, which gathers every page of every row each
  step: once the pool is full of cached pages, new sequences otherwise get them scattered,
  and a batch-32 bench-20m step on such page tables took 13.5 ms against 11.8 ms on
  consecutive ones (same run)."""

  def __init__(self, num_pages: int, page_size: int, cached_yield_to_order: bool = False):
    self.num_pages, self.page_size = num_pages, page_size
    self.cached_yield_to_order = cached_yield_to_order
    self._unused = np.ones(num_pages, bool)  # never used, or freed (not cached)
    self._unused_count = num_pages  # kept, not summed: `free` is asked per row and step
    self._claimed = np.zeros(num_pages, bool)  # unused, but kept for a sequence to grow into
    self.holders = np.zeros(num_pages, np.int32)
    self._page_of: dict[bytes, int] = {}  # block hash -> the page holding that block
    self._hash_of: dict[int, bytes] = {}
    self._idle: collections.OrderedDict = collections.OrderedDict()  # cached, unheld; oldest first
    self.evictions = 0

  @property
  def free(self) -> int:
    """Pages a sequence can take: never used, or cached but held by nobody."""
    return self._unused_count + len(self._idle)

  @property
  def cached(self) -> int:
    return len(self._page_of)

  def _take(self, page: int | None = None) -> int:
    """`page` if given (unused, or cached and held by nobody), else the lowest unused page
    nobody has claimed, else the lowest unused one, else the least recently used cached page
    nobody holds."""
    if page is None and self._unused_count:
      open_ = self._unused & ~self._claimed
      page = int(np.argmax(open_ if open_.any() else self._unused))
    if page is not None and page in self._idle:  # a cached page, given: its block goes
      del self._idle[page]
      self._evict(page)
    elif page is not None:
      self._unused[page] = self._claimed[page] = False
      self._unused_count -= 1
    else:  # the least recently used cached page nobody holds
      page, _ = self._idle.popitem(last=False)
      self._evict(page)
    self.holders[page] = 1
    return page

  def _evict(self, page: int):
    del self._page_of[self._hash_of.pop(page)]
    self.evictions += 1

  def _drop(self, page: int):
    self.holders[page] -= 1
    if self.holders[page] == 0:
      if page in self._hash_of:
        self._idle[page] = None  # most recently used last
      else:
        self._unused[page] = True
        self._unused_count += 1

  def share(self, held: list[int], hashes: list[bytes]) -> int:
    """Extend `held` (which ends where hashes[0]'s block starts) with the cached pages of the
    longest run of `hashes` found; returns how many."""
    taken = 0
    for block in hashes:
      page = self._page_of.get(block)
      if page is None:
        break
      if self.holders[page] == 0:
        del self._idle[page]
      self.holders[page] += 1
      held.append(page)
      taken += 1
    return taken

  def cached_run(self, hashes: list[bytes]) -> int:
    """How many of `hashes`, from the first, are cached blocks (nothing taken)."""
    found = 0
    while found < len(hashes) and hashes[found] in self._page_of:
      found += 1
    return found

  def index(self, page: int, block: bytes):
    """Record that `page` holds the block with hash `block` (now complete), unless another
    page already does."""
    if block not in self._page_of and page not in self._hash_of:
      self._page_of[block], self._hash_of[page] = page, block

  def pages_for(self, tokens: int) -> int:
    return -(-tokens // self.page_size)

  def grow(self, held: list[int], tokens: int, extent: int = 0) -> bool:
    """Extend `held` in place to cover `tokens` positions; False (nothing taken) if the pool
    has too few free pages.

    A sequence's pages are kept consecutive where the pool allows: the page after its last
    one when that is unused (or cached and unheld, with `cached_yield_to_order`), else the
    start of an unclaimed run of unused pages long enough for the rest of its `extent` (the
    most pages it expects to hold), whose rest is then claimed for it. Claims only steer
    placement: when nothing else is unused, claimed pages are taken too. (Decode attention
    on CPU gathers every page of every row: at batch 32 a step took 25% longer with each
    row's pages scattered than consecutive.)"""
    need = self.pages_for(tokens) - len(held)
    if need > self.free:
      return False
    for _ in range(max(need, 0)):
      last = held[-1] if held and held[-1] != RELEASED else None
      if last is not None and last + 1 < self.num_pages and (
          self._unused[last + 1] or (self.cached_yield_to_order and last + 1 in self._idle)):
        held.append(self._take(last + 1))
      elif (rest := extent - len(held)) > 1 and (start := self._open_run(rest)) is not None:
        self._claimed[start + 1:start + rest] = True
        held.append(self._take(start))
      else:
        held.append(self._take())
    return True

  def _open_run(self, length: int) -> int | None:
    """The first page of the first run of `length` unused, unclaimed pages, if any."""
    open_ = np.concatenate([[0], (self._unused & ~self._claimed).astype(np.int32)])
    runs = np.cumsum(open_)
    fits = np.flatnonzero(runs[length:] - runs[:-length] == length)
    return int(fits[0]) if fits.size else None

  def release_before(self, held: list[int], position: int):
    """Hand back the pages of `held` wholly before `position`; their places stay (as
    RELEASED), so held[i] is still the page of positions i * page_size onwards."""
    i = min(max(position, 0) // self.page_size, len(held)) - 1
    while i >= 0 and held[i] != RELEASED:  # released pages are always a prefix
      self._drop(held[i])
      held[i] = RELEASED
      i -= 1

  def release(self, held: list[int]):
    """Hand back every page of `held`, and the claim on the pages it would have grown into."""
    if held and held[-1] != RELEASED:
      after = held[-1] + 1
      while after < self.num_pages and self._claimed[after]:
        self._claimed[after] = False
        after += 1
    for page in reversed(held):
      if page != RELEASED:
        self._drop(page)
    held.clear()


def block_hashes(tokens: list[int], page_size: int, start: int = 0, previous: bytes = b"") -> list[bytes]:
  """Hashes of the complete page_size blocks of `tokens` from block `start` on; each covers
  its block's tokens and, through `previous` (block start - 1's hash), all before them."""
  hashes = []
  for begin in range(start * page_size, len(tokens) - page_size + 1, page_size):
    block = ",".join(map(str, tokens[begin:begin + page_size])).encode()
    previous = hashlib.blake2b(previous + block, digest_size=16).digest()
    hashes.append(previous)
  return hashes


def held_pages(held: list[int]) -> int:
  """Pages a sequence holds now (released places not counted)."""
  return sum(page != RELEASED for page in held)


def table_widths(pages_per_seq: int, page_size: int, gathers: bool) -> tuple[int, ...]:
  """The page-table widths the decode step is compiled for, narrowest first. Where decode
  attention gathers every page its table names (XLA on CPU), a step costs the table's width
  whatever the sequences' lengths, so halved widths are compiled too, down to
  NARROWEST_TABLE positions, and each step takes the narrowest that holds its longest
  sequence. The Pallas kernels read only each sequence's own pages: one width serves."""
  widths = [pages_per_seq]
  while gathers and (half := -(-widths[-1] // 2)) < widths[-1] and half * page_size >= NARROWEST_TABLE:
    widths.append(half)
  return tuple(reversed(widths))


def page_table_rows(held: list[list[int]], width: int, num_pages: int) -> np.ndarray:
  """[len(held), width] int32 page table of a pool of `num_pages`. Entries past a
  sequence's pages name the pages after its last one (round the pool); released entries
  name page 0. Attention never uses them (it masks positions past each sequence's length and
  before its window), but the CPU decode gathers every entry of every row, and reading on
  from a row's last page is faster there than reading one page again and again: 2.99 ms
  against 3.64 ms for bench-20m's 4 layers of batch-32 attention, 6 pages used of 9."""
  rows = []  # built as lists: per-row NumPy calls took 0.11 ms for 32 rows, lists 0.05
  for pages in held:
    after = (pages[-1] + 1) if pages else 0
    rows.append([max(page, 0) for page in pages] + [(after + j) % num_pages for j in range(width - len(pages))])
  return np.asarray(rows, np.int32).reshape(len(held), width)
