"""The engine's side of prefix caching (the pool's side is in pages.py): before a request's
next prompt chunk, take the cached pages of the blocks it starts with; after positions are
written, index the pages they completed, so later requests can take them.

Requests whose prompts arrive together would each compute a shared prefix before any of
them has indexed it; `next_block` and `computing` let the engine hold back, for one chunk, a
request whose next block another request is computing right then. A request that scores its prompt
(prompt_logprobs) computes every position itself (it needs their logits) but still indexes
its pages. Shared pages are only ever complete ones: nothing writes into them again, and in
a quantized cache they are the quantized pool pages, never a sequence's float tail.
"""

from jaxpar.inference.pages import RELEASED, block_hashes


def chain_start(adapter: int) -> bytes:
  """What a prompt's chain of block hashes starts from: another adapter writes other keys and
  values for the same tokens, so it has its own chain."""
  return b"adapter %d" % adapter if adapter else b""


class PrefixSharing:
  def __init__(self, pool, stats, enabled: bool):
    self.pool, self.stats, self.enabled = pool, stats, enabled

  def _hashes(self, request, blocks: int) -> list[bytes]:
    """The hashes of request's first `blocks` complete blocks (computed once, as it grows)."""
    known = request.block_hashes
    if len(known) < blocks:
      context = request.context[:blocks * self.pool.page_size]
      known += block_hashes(context, self.pool.page_size, len(known),
                            known[-1] if known else chain_start(request.adapter))
    return known[:blocks]

  def reuse(self, request):
    """Skip the blocks at request's prefill point that are cached (not its last token's)."""
    size = self.pool.page_size
    if not self.enabled or request.prompt_logprobs is not None or request.cached % size \
        or len(request.pages) != request.cached // size:
      return
    if not request.looked_up:  # counted once per admission
      request.looked_up = True
      self.stats["prefix_cache_queries"] += len(request.context) - 1 - request.cached
    start, limit = request.cached // size, (len(request.context) - 1) // size
    taken = self.pool.share(request.pages, self._hashes(request, limit)[start:])
    request.cached += taken * size
    request.prefix_hits += taken * size
    self.stats["prefix_cache_hits"] += taken * size

  def next_block(self, request):
    """The hash of the block request's next chunk starts computing (None: not a complete block)."""
    size = self.pool.page_size
    index = request.cached // size
    if not self.enabled or (index + 1) * size > len(request.context) - 1:
      return None
    return self._hashes(request, index + 1)[index]

  def computing(self, request, end: int) -> set:
    """Hashes of the blocks request completes by writing positions up to `end`."""
    if not self.enabled:
      return set()
    size = self.pool.page_size
    return set(self._hashes(request, end // size)[request.cached // size:])

  def publish(self, request):
    """Index the pages request has completed since it last did."""
    if not self.enabled:
      return
    complete = request.cached // self.pool.page_size
    if complete == request.published:  # most decode steps complete no page
      return
    for index, block in enumerate(self._hashes(request, complete)[request.published:], request.published):
      if request.pages[index] != RELEASED:
        self.pool.index(request.pages[index], block)
    request.published = complete
