"""The page pool keeps each sequence's pages consecutive where it can (CPU decode gathers
them faster), without that ever costing capacity."""

from jaxpar.inference.pages import RELEASED, PagePool, page_table_rows


def test_sequences_growing_in_lockstep_keep_consecutive_pages():
  pool = PagePool(num_pages=40, page_size=4)
  rows = [[] for _ in range(4)]
  for row in rows:  # prompts of 2 pages each, expecting 10 pages in all
    assert pool.grow(row, 8, extent=10)
  for tokens in range(9, 41):  # then one token at a time, all rows in turn
    for row in rows:
      assert pool.grow(row, tokens, extent=10)
  for row in rows:
    assert row == list(range(row[0], row[0] + 10)), row
  assert sorted(p for row in rows for p in row) == list(range(40))


def test_without_an_extent_pages_interleave():
  """What the claims prevent: rows that take pages in turn get every fourth page."""
  pool = PagePool(num_pages=16, page_size=4)
  rows = [[] for _ in range(4)]
  for tokens in range(1, 17, 4):
    for row in rows:
      pool.grow(row, tokens)
  assert rows[0] == [0, 4, 8, 12]


def test_claimed_pages_are_still_handed_out_when_nothing_else_is_free():
  pool = PagePool(num_pages=8, page_size=1)
  first, second = [], []
  assert pool.grow(first, 1, extent=8)  # claims pages 1..7
  assert pool.free == 7
  assert pool.grow(second, 7, extent=7)  # no unclaimed run: takes claimed pages
  assert pool.free == 0 and not pool.grow(first, 2)
  pool.release(second)
  assert pool.free == 7 and pool.grow(first, 8) and first == list(range(8))


def test_release_drops_the_claim():
  pool = PagePool(num_pages=12, page_size=1)
  a, b = [], []
  pool.grow(a, 2, extent=6)  # pages 0-1, claims 2-5
  pool.release(a)
  pool.grow(b, 1, extent=12)  # the whole pool is one open run again
  assert b == [0]
  pool.grow(b, 12, extent=12)
  assert b == list(range(12))


def test_a_sequence_past_its_window_keeps_growing_in_place():
  pool = PagePool(num_pages=10, page_size=2)
  row = []
  pool.grow(row, 6, extent=10)
  pool.release_before(row, 4)  # pages of positions 0-3 handed back
  assert row[:2] == [RELEASED, RELEASED]
  pool.grow(row, 10, extent=10)
  assert row[2:] == [2, 3, 4]


def _pool_full_of_cached_blocks(cached_yield_to_order):
  """Two finished sequences of 4 pages each, every block indexed (cached, held by nobody);
  then a new sequence shares the first sequence's first 2 blocks and grows to 4 pages."""
  pool = PagePool(num_pages=8, page_size=1, cached_yield_to_order=cached_yield_to_order)
  first, second = [], []
  pool.grow(first, 4, extent=4)
  pool.grow(second, 4, extent=4)
  for page, block in zip(first + second, [b"a0", b"a1", b"a2", b"a3", b"b0", b"b1", b"b2", b"b3"]):
    pool.index(page, block)
  pool.release(second)  # released first: its blocks are the least recently used
  pool.release(first)
  row = []
  assert pool.share(row, [b"a0", b"a1", b"x"]) == 2
  pool.grow(row, 4)
  return pool, row


def test_with_cached_yield_to_order_a_sequence_grows_in_place_over_cached_blocks():
  pool, row = _pool_full_of_cached_blocks(True)
  assert row == [0, 1, 2, 3]  # its own successors, though they held cached blocks
  assert pool.evictions == 2 and pool.share([], [b"a0", b"a1", b"a2"]) == 2  # a2 went, a0-a1 stay
  assert pool.share([], [b"b0", b"b1", b"b2", b"b3"]) == 4  # the older blocks were spared


def test_without_it_the_least_recently_used_cached_blocks_go_first():
  pool, row = _pool_full_of_cached_blocks(False)
  assert row == [0, 1, 7, 6]  # the second sequence's blocks (released first, last page first) went
  assert pool.share([], [b"a0", b"a1", b"a2", b"a3"]) == 4


def test_table_entries_past_a_sequence_read_on_from_its_last_page():
  """Entries no attention uses: the pages after the row's last one (round the pool), which
  the CPU gather reads faster than one page over and over; released entries stay page 0."""
  table = page_table_rows([[4, 5], [RELEASED, 8], [], [9]], width=4, num_pages=10)
  assert table.tolist() == [[4, 5, 6, 7], [0, 8, 9, 0], [0, 1, 2, 3], [9, 0, 1, 2]]
