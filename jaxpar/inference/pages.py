"""The KV cache's page pool: which pages are free, and which each sequence holds.

Host-side bookkeeping only; the pages themselves live on the devices (models/kv_cache.py).
A sequence gets pages as it grows, so memory follows actual lengths, not the maximum.
When every layer attends through a sliding window, the pages wholly before the window of
a sequence's next query are handed back while it goes on (`release_before`): a long
generation then holds about window / page_size + 1 pages.
"""

import numpy as np

RELEASED = -1  # the place of a page handed back while its sequence goes on


class PagePool:
  def __init__(self, num_pages: int, page_size: int):
    self.num_pages, self.page_size = num_pages, page_size
    self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first

  @property
  def free(self) -> int:
    return len(self._free)

  def pages_for(self, tokens: int) -> int:
    return -(-tokens // self.page_size)

  def grow(self, held: list[int], tokens: int) -> bool:
    """Extend `held` in place to cover `tokens` positions; False (nothing taken) if the pool
    has too few free pages."""
    need = self.pages_for(tokens) - len(held)
    if need > len(self._free):
      return False
    held.extend(self._free.pop() for _ in range(max(need, 0)))
    return True

  def release_before(self, held: list[int], position: int):
    """Hand back the pages of `held` wholly before `position`; their places stay (as
    RELEASED), so held[i] is still the page of positions i * page_size onwards."""
    i = min(max(position, 0) // self.page_size, len(held)) - 1
    while i >= 0 and held[i] != RELEASED:  # released pages are always a prefix
      self._free.append(held[i])
      held[i] = RELEASED
      i -= 1

  def release(self, held: list[int]):
    self._free.extend(page for page in reversed(held) if page != RELEASED)
    held.clear()


def held_pages(held: list[int]) -> int:
  """Pages a sequence holds now (released places not counted)."""
  return sum(page != RELEASED for page in held)


def page_table_rows(held: list[list[int]], width: int) -> np.ndarray:
  """[len(held), width] int32 page table; unused and released entries point at page 0
  (never read: attention masks positions past each sequence's length, and reads no page
  before its window)."""
  table = np.zeros((len(held), width), np.int32)
  for row, pages in enumerate(held):
    table[row, :len(pages)] = np.maximum(pages, 0)
  return table
