"""The KV cache's page pool: which pages are free, and which each sequence holds.

Host-side bookkeeping only; the pages themselves live on the devices (models/kv_cache.py).
A sequence gets pages as it grows, so memory follows actual lengths, not the maximum.
"""

import numpy as np


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

  def release(self, held: list[int]):
    self._free.extend(reversed(held))
    held.clear()


def page_table_rows(held: list[list[int]], width: int) -> np.ndarray:
  """[len(held), width] int32 page table; unused entries point at page 0 (never read: the
  attention masks positions past each sequence's length)."""
  table = np.zeros((len(held), width), np.int32)
  for row, pages in enumerate(held):
    table[row, :len(pages)] = pages
  return table
