"""The generation engine: continuous batching over a paged KV cache.

A fixed number of slots decode together, one token each per step (one compiled program;
on CPU, one per page-table width: `pages.table_widths`); while nothing else happens, each
step is dispatched before the previous one's tokens are read (decode_batch.py).
Between steps, waiting requests take free slots and their prompts are written into the
cache a chunk at a time (a few compiled chunk lengths), a bounded number of prompt tokens
per step, so a long prompt never stalls the running decodes for its whole prefill. Prompts
that arrive together are written together: each chunk length is also compiled for as many
rows as the budget allows. Finished requests free their slot and pages at once. When every
layer attends through a sliding window, a request also hands back the pages wholly before
its window as it goes on (where only some layers slide, those keep rings of their window's
pages per slot: models/kv_cache_windowed.py). When the page pool runs dry, the newest
request is preempted: its pages are freed and it is recomputed later, with the same tokens, since a row's random key
depends only on its seed and position.
"""

import collections
import logging
import queue
import time
from typing import Iterator

import jax
import numpy as np

from jaxpar.errors import ConfigError
from jaxpar.inference import processing
from jaxpar.inference.adapters import stacked_adapters
from jaxpar.inference.decode_batch import DecodeBatch, DecodeCalls
from jaxpar.inference.intake import RequestIntake
from jaxpar.inference.pages import PagePool, page_table_rows, table_widths
from jaxpar.inference.prefix_cache import PrefixSharing
from jaxpar.inference.programs import Programs, burst_kind, program_key
from jaxpar.inference.requests import Completion, Request, TokenEvent
from jaxpar.inference.sampling import GREEDY, SamplingParams
from jaxpar.inference.draft_length import WidthChooser
from jaxpar.inference.speculative import DraftSource, SpeculativeCalls, rolling_back, with_masks
from jaxpar.mesh import logical_to_sharding, num_shards
from jaxpar.models import caches, kv_cache, kv_reach, local_window
from jaxpar.models.kv_cache import head_repeat
from jaxpar.models.kv_quant import KVQuantization
from jaxpar.weights import open_run

DEFAULT_CHUNKS = (16, 64, 256)
_log = logging.getLogger(__name__)


def bytes_to_move(tree, shardings) -> int:
  """Bytes of `tree`'s arrays not laid out as `shardings` (a tree of the same structure) say:
  what placing it there copies between devices."""
  return sum(x.nbytes for x, want in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)) if x.sharding != want)


class Engine(RequestIntake, DecodeCalls, SpeculativeCalls):
  """Generate from a model on a device mesh (`Engine.from_checkpoint` to load one).

  slots: sequences decoded together; max_seq_len: longest prompt + completion (default the
  model's); page_size / num_pages: the KV cache pool (default: every slot at max_seq_len;
  with a sliding window on every layer a sequence needs only its window's pages);
  prefill_chunks: the prompt chunk lengths compiled; prefill_budget: prompt tokens written
  per step before the decode step runs (default: the longest chunk, and at least 512), which
  bounds how long new prompts delay the running decodes; kv_cache: "int8" | "int4" | "int2" stores the cache
  quantized (models/kv_cache_quantized.py), None or "float" in the compute dtype.
  The plain programs compile in the constructor; those for requests that adjust logits or
  ask for prompt log-probabilities (`processing.py`) on first use, or there too with
  `compile_extras` (a server should not pause the running decodes to compile).
  prefix_caching: requests share the cache pages of the prompt blocks they have in common
  (`prefix_cache.py`); outputs are the same either way (off where local layers' rings or
  linear layers' states cannot be shared).
  cache_bytes: device bytes of the cache, {"pool": the page pool's, "rings": the local layers',
  "states": linear-attention layers' per-slot states}.
  decode_burst: decode steps run in one device call (`programs.burst_kind`) while no request
  waits, prefills, adjusts logits or has yet to stream its first token: the host round trip
  and dispatch once per K tokens, the same tokens, streamed K at a time.
  run_ahead: while nothing can change between single decode steps, dispatch the next step
  before reading this one's tokens (`decode_batch.py`): the host's work on them overlaps
  the device's next step; the same tokens, streamed as they come.
  adapters: the names of the LoRA adapters stacked in `params` (model.lora.stacked, slots 1..n;
  `adapters.py` builds them); a request names one (`submit(..., adapter=NAME)`) or gets the base.
  speculative: a draft source (`speculative.DraftModel`: a smaller model; `NgramDraft`: prompt
  lookup; `medusa.MedusaDraft`: the model's own draft heads) whose proposals every decoding
  row checks, up to k at a time (or a tree of them), instead of single decode steps (greedy
  tokens are the same; sampled ones follow the same distribution).
  """

  def __init__(self, runtime, params, tokenizer, *, model_state=None, slots: int = 8,
               max_seq_len: int | None = None, page_size: int = 16, num_pages: int | None = None,
               prefill_chunks=DEFAULT_CHUNKS, prefill_budget: int | None = None, cache_dtype=None,
               kv_cache: str | None = None, echo=None, compile_extras: bool = False,
               prefix_caching: bool = True, adapters: tuple[str, ...] = (), decode_burst: int = 1,
               run_ahead: bool = True, speculative: DraftSource | None = None):
    cfg = runtime.model_config
    self.adapters = tuple(adapters)  # one name per stacked adapter (adapters.py builds both)
    if decode_burst < 1:
      raise ConfigError(f"decode_burst={decode_burst} must be >= 1 (1: one decode step per call)")
    self.decode_burst, self.run_ahead = decode_burst, run_ahead
    self._ahead: DecodeBatch | None = None  # a decode step dispatched and not yet read
    runtime.plan.check_generation()
    self.runtime, self.params, self.tokenizer = runtime, params, tokenizer
    self.lockstep = None  # serving from several processes: process 0 publishes each program call (lockstep.py)
    # Disaggregated prefill (disaggregated.py): a prefill engine hands each written prompt on
    # (handoff(request, slot)); a decode engine takes a moved prompt into a slot (adopt(request, slot)).
    self.handoff = self.adopt = None
    self.model_state = model_state if model_state is not None else {}
    self.max_seq_len = min(max_seq_len or cfg.max_seq_len, cfg.max_seq_len)
    self.pages_per_seq = -(-self.max_seq_len // page_size)
    # Decode steps take the narrowest of these page tables that holds their longest sequence.
    gathers = runtime.mesh.devices.flat[0].platform not in ("tpu", "gpu")
    self.step_widths = table_widths(self.pages_per_seq, page_size, gathers)
    self.local_window = local_window(cfg)  # rings hold a window and a write of at most one window
    self.chunks = sorted({min(c, self.max_seq_len, self.local_window or c) for c in prefill_chunks})
    # Keys further back than this are never read again (None: some layer sees everything).
    self.reach = kv_reach(cfg)
    # The most pages one sequence holds at once: a prompt chunk and the window before it.
    most = self.pages_per_seq if self.reach is None else min(
        self.pages_per_seq, (self.chunks[-1] + self.reach - 2) // page_size + 2)
    num_pages = num_pages or slots * self.pages_per_seq
    if num_pages < most:
      raise ConfigError(f"num_pages={num_pages} cannot hold one sequence of max_seq_len="
                        f"{self.max_seq_len} ({most} pages of {page_size} at once): raise it")
    self.pool = PagePool(num_pages, page_size, cached_yield_to_order=gathers)
    self.prefill_budget = prefill_budget or max(self.chunks[-1], 512)
    # Rows of the widest fill program per chunk length: one row always, more when they fit the budget.
    self.fill_rows = {c: max(1, min(slots, self.prefill_budget // c)) for c in self.chunks}
    self.kv_quantization = None if kv_cache in (None, "float") else KVQuantization(kv_cache, page_size, 0)
    self._cache_layout = (num_pages, page_size, cache_dtype or cfg.compute_dtype)
    # More tensor devices than KV heads: each keeps the head its query heads read, repeated.
    self.kv_repeat = head_repeat(cfg, num_shards("cache_kv_heads", runtime.mesh, runtime.rules))
    self.slots: list[Request | None] = [None] * slots
    self.draft = speculative  # a draft source may keep layers of its own in the cache (an MTP module)
    self.cache = self._empty_cache(*self._cache_layout)
    self.cache_bytes = caches.cache_bytes(self.cache)
    self.waiting: collections.deque[Request] = collections.deque()
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self.programs = Programs(runtime, params, self.model_state, self.cache, self.kv_quantization)
    if speculative is not None:
      speculative.bind(self)
      self._round = rolling_back(speculative.target_program)  # the target's pass and acceptance test
      for width in speculative.widths:
        self.programs.compile("speculate", slots, width + 1, self.pages_per_seq, self._round)
      self._widths = WidthChooser(speculative.widths)
    self._compile_all(echo or (lambda text: None), compile_extras)
    self.stats = collections.Counter()
    if prefix_caching and self.cache_bytes["states"]:
      # A shared prompt block would need the recurrent state as of its end, which is not kept.
      _log.info("prefix caching is off: the model's linear-attention layers keep one state per sequence, "
                "not per prompt block, so requests cannot share prompt pages")
    self.sharing = PrefixSharing(self.pool, self.stats, prefix_caching and self.local_window is None
                                 and not self.cache_bytes["states"])

  @classmethod
  def from_run(cls, run, *, tokenizer=None, adapters: dict | None = None, **options) -> "Engine":
    """An engine over a loaded saved run (jaxpar.open_run) with its tokenizer; `adapters`
    ({name: adapter checkpoint}) are served beside the base, batched together."""
    run.model  # noqa: B018  (raises, naming the fix, when the run is not loaded)
    runtime, params = stacked_adapters(run, adapters) if adapters else (run.runtime, run.params)
    return cls(runtime, params, tokenizer or run.tokenizer, model_state=run.model_state,
               adapters=tuple(adapters or ()), **options)

  @classmethod
  def from_checkpoint(cls, path, *, mesh=None, devices=None, step: int | None = None, tokenizer=None,
                      **options) -> "Engine":
    """An engine for a saved run (a train run's, or `jaxpar convert hf-to-jaxpar`'s) on `mesh`
    (a MeshConfig or a dict of axis sizes; default: data parallel, every device holding the
    whole model, which suits models that fit one device; larger ones set `tensor`), with the
    tokenizer that goes with it."""
    with open_run(path, mesh or {"data": -1, "fsdp": 1}, step, devices=devices) as run:
      return cls.from_run(run, tokenizer=tokenizer, **options)

  # -- construction ------------------------------------------------------------------

  def _empty_cache(self, num_pages, page_size, dtype):
    runtime = self.runtime
    model = runtime.merge(self.params, self.model_state)
    def make():
      cache = model.init_cache(num_pages, page_size, dtype, kv_quantization=self.kv_quantization,
                               slots=len(self.slots), kv_repeat=self.kv_repeat)
      return cache if self.draft is None else {**cache, **self.draft.init_cache(model, num_pages, page_size, dtype,
                                                                                 len(self.slots))}
    shapes = jax.eval_shape(make)
    shardings = jax.tree.map(
        lambda s: logical_to_sharding(kv_cache.STACKED_NAMES, s.shape, runtime.mesh, runtime.rules), shapes)
    with runtime.context():
      return jax.jit(make, out_shardings=shardings)()

  def _compile_all(self, echo, extras: bool):
    fills = sorted({(rows, c) for c, widest in self.fill_rows.items() for rows in (1, widest)})
    kinds = ("step", "burst") if self.decode_burst > 1 else ("step",)
    steps = [(kind, len(self.slots), 1, width) for width in self.step_widths for kind in kinds]
    shapes = steps + [("fill", rows, c, self.pages_per_seq) for rows, c in fills]
    if extras:
      shapes += [("step_processed", *step[1:]) for step in steps if step[0] == "step"]
      shapes += [("fill_logprobs", rows, c, self.pages_per_seq) for rows, c in fills]
      if self.draft is not None:  # rounds with a grammar row
        shapes += [("speculate_masked", len(self.slots), w + 1, self.pages_per_seq) for w in self.draft.widths]
    started = time.perf_counter()
    for i, (kind, batch, length, width) in enumerate(shapes, 1):
      echo(f"compiling {kind} [{batch} x {length}] ({i}/{len(shapes)})")
      self._compile(kind, batch, length, width)
    self.compile_s = time.perf_counter() - started

  def _compile(self, kind, batch, length, width):
    extra = {"step_processed": processing.step_processed_kind(self.max_seq_len),
             "fill_logprobs": processing.FILL_LOGPROBS,
             "burst": burst_kind(self.decode_burst),
             "speculate_masked": self.draft and with_masks(self._round),
             "fill": self.draft and self.draft.fill_program}.get(kind)
    self.programs.compile(kind, batch, length, width, program=extra)

  def _compiled(self, kind, rows):
    """Compile the program for these rows if it is not yet (`processing`'s, on first use)."""
    if (key := program_key(kind, rows)) not in self.programs.compiled:
      self._compile(*key)

  def _run(self, kind, *rows):
    """Run a program, compiling `processing`'s on first use."""
    self._compiled(kind, rows)
    if self.adapters:  # each row's adapter, after its slot (rows[3]): the request's in that slot
      picked = [0 if self.slots[s] is None else self.slots[s].adapter for s in rows[3]]
      rows = (*rows[:4], np.asarray(picked, np.int32), *rows[4:])
    if self.lockstep is not None:  # the other processes run it too
      self.lockstep.publish(self, kind, rows)
    outputs = self.programs.run(kind, self.params, self.model_state, self.cache, *rows)
    if self.lockstep is not None:  # a later call may take them as they are (run-ahead)
      self.lockstep.returned(self, outputs)
    return outputs

  def replay(self, kind, rows):
    """Run a program call published by process 0 (lockstep.py), rows as it ran them (adapters
    included); keep the cache it returns, and return its outputs."""
    self._compiled(kind, rows)
    outputs = self.programs.run(kind, self.params, self.model_state, self.cache, *rows)
    self.cache = outputs[-1] if isinstance(outputs, tuple) else outputs
    return outputs

  def load_weights(self, params, model_state=None) -> int:
    """Generate from `params` (and `model_state`) from now on: the same trees as the engine's,
    e.g. a trainer's current weights. Arrays already laid out as the engine's programs expect
    are used as they are; others are resharded device to device (another layout, or other
    devices). The prefix cache is emptied (its pages hold the old weights' keys and values).
    Returns the bytes that moved. Only between requests: one in flight would mix two models."""
    if self.has_work:
      raise RuntimeError("load_weights with requests in flight: finish or reset them first")
    params_want, state_want = self.programs.state_shardings
    trees, wanted = (params, model_state or {}), (params_want, state_want if model_state is not None else {})
    moved = bytes_to_move(trees, wanted)
    self.params = jax.device_put(params, params_want)  # arrays already in place are not copied
    if model_state is not None:
      self.model_state = jax.device_put(model_state, state_want)
    self.pool = PagePool(self.pool.num_pages, self.pool.page_size, cached_yield_to_order=self.pool.cached_yield_to_order)
    self.sharing = PrefixSharing(self.pool, self.stats, self.sharing.enabled)
    return moved

  # -- one step ----------------------------------------------------------------------

  def step(self) -> list:
    """Admit waiting requests, run prefill chunks (oldest request first, up to the prefill
    budget), then one decode step for every slot ready to decode. Returns the TokenEvents
    produced (also sent to each on_event)."""
    events = []
    while not self._inbox.empty():
      self.waiting.append(self._inbox.get())
    if self._ahead is not None and self.waiting:  # the batch will change: take the step in flight first
      batch, self._ahead = self._ahead, None
      events += self._accept(batch)
    for request in [r for r in [*self.waiting, *self.slots] if r is not None and r.cancelled]:
      events.append(self._end(request, "cancelled"))
    for i, slot in enumerate(self.slots):
      if slot is None and self.waiting:
        if self.waiting[0].moved is not None and not self.adopt(self.waiting[0], i):
          break  # no pages free for its prompt yet: it waits for them
        self.slots[i] = self.waiting.popleft()
    budget = self.prefill_budget
    while budget > 0 and (prefilling := [r for r in self.slots if r is not None and r.prefilling]):
      budget -= self.prefill(sorted(prefilling, key=lambda r: r.arrival))
    for request in [r for r in self.slots if r is not None and not r.prefilling and not r.sampling.max_tokens]:
      events.append(self._end(request, "length"))  # max_tokens 0: the prompt was all it wanted
    if self.handoff is not None:  # a prefill engine: written prompts go on to be decoded elsewhere
      for i, request in enumerate(self.slots):
        if request is not None and not request.prefilling:
          self.slots[i] = None
          self.handoff(request, i)
      return events
    if any(r is not None and not r.prefilling for r in self.slots):
      events += self._speculate() if self.draft is not None else self._decode()
    return events

  def _grow(self, request: Request, tokens: int) -> bool:
    """Pages for `tokens` positions of `request` if the pool has them, after handing back
    those wholly before the window of its next query (at position `request.cached`)."""
    if self.reach is not None:
      self.pool.release_before(request.pages, request.cached - self.reach + 1)
    expected = min(len(request.prompt) + request.sampling.max_tokens, self.max_seq_len)
    return self.pool.grow(request.pages, tokens, extent=self.pool.pages_for(expected))

  def _reserve(self, request: Request, tokens: int):
    """Pages for `tokens` positions of `request`, preempting the newest other requests."""
    while not self._grow(request, tokens):
      newest = max((r for r in self.slots if r is not None and r is not request), key=lambda r: r.arrival)
      self._release(newest)  # recomputed later with the same tokens (its cached blocks kept)
      newest.cached = newest.published = 0
      newest.looked_up = False
      self.slots[self.slots.index(newest)] = None
      self.waiting.appendleft(newest)
      self.stats["preemptions"] += 1

  def prefill(self, requests: list[Request]) -> int:
    """Write the next prompt chunk of requests[0] into the cache, together with the next
    chunks of as many of the others (in order) as the widest fill program for that chunk
    length holds: one compiled `fill`. Returns the prompt positions it computed (padding
    included)."""
    for request in requests:
      self.sharing.reuse(request)
    if not (requests := [r for r in requests if r.prefilling]):
      return 0
    first = requests[0]
    remaining = len(first.context) - 1 - first.cached
    fitting = [c for c in self.chunks if c <= remaining]
    chunk = fitting[-1] if fitting else next(c for c in self.chunks if c >= remaining)
    end = lambda r: min(r.cached + chunk, len(r.context) - 1)  # noqa: E731
    self._reserve(first, end(first))
    # The others join only if their pages are free (they never preempt anyone) and their next
    # block is not one this chunk is computing (they take it from the prefix cache instead).
    group, computing = [first], self.sharing.computing(first, end(first))
    for request in requests[1:self.fill_rows[chunk]]:
      if self.sharing.next_block(request) not in computing and self._grow(request, end(request)):
        group.append(request)
        computing |= self.sharing.computing(request, end(request))
    rows = 1 if len(group) == 1 else self.fill_rows[chunk]
    tokens = np.zeros((rows, chunk), np.int32)
    positions = np.full((rows, chunk), -1, np.int32)
    tails = np.zeros((rows,), np.int32)  # padding rows write nothing
    # The token after each, for a draft whose own layer pairs them (an MTP module's fill program).
    pairs = self.draft is not None and self.draft.fill_program is not None
    following = np.zeros((rows, chunk), np.int32)
    for i, request in enumerate(group):
      start = request.cached
      count = min(chunk, len(request.context) - 1 - start)
      tokens[i, :count] = request.context[start:start + count]
      positions[i, :count] = np.arange(start, start + count)
      if pairs:  # a prompt chunk stops before the last token, so each has its successor
        following[i, :count] = request.context[start + 1:start + count + 1]
      # A request's slot names its tail page in a quantized cache (a speculative draft's
      # copies are in no slot: their row is their target's slot).
      tails[i] = self.slots.index(request) if request in self.slots else request.row
      request.cached += count
      self.stats["prefill_tokens"] += count
    table = page_table_rows([r.pages for r in group] + [[]] * (rows - len(group)), self.pages_per_seq,
                            self.pool.num_pages)
    for request in group:
      self.sharing.publish(request)  # indexed now: the program below writes them before any later one reads
    if not any(r.prompt_logprobs is not None for r in group):
      self.cache = self._run("fill", tokens, positions, table, tails, *((following,) if pairs else ()))
      return rows * chunk
    targets = processing.prompt_targets(group, tokens, positions)
    outputs = self._run("fill_logprobs", tokens, positions, table, tails, targets)
    self.cache = outputs[-1]
    processing.record_prompt_logprobs(group, positions, *outputs[:-1])
    return rows * chunk

  def reset(self) -> list[Request]:
    """After a failed step: end every request in flight ("error"), free every page, and
    rebuild the cache if the failure consumed its buffers. Returns the ended requests."""
    ended = [r for r in [*self.waiting, *self.slots] if r is not None]
    while not self._inbox.empty():
      ended.append(self._inbox.get())
    for request in ended:
      request.finish_reason = "error"
      self._release(request)
    self.slots = [None] * len(self.slots)
    self.waiting.clear()
    self._ahead = None
    if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
      self.cache = self._empty_cache(*self._cache_layout)
    return ended

  def _release(self, request: Request):
    """Hand back the pages of a request (and its draft's, when decoding speculatively)."""
    self.pool.release(request.pages)
    if self.draft is not None:
      self.draft.forget(request)

  def _free(self, request: Request):
    self._release(request)
    if request in self.slots:
      self.slots[self.slots.index(request)] = None
    elif request in self.waiting:
      self.waiting.remove(request)

  def _end(self, request: Request, reason: str):
    request.finish_reason = reason
    self._free(request)
    return self._deliver(request, TokenEvent(request.id, None, "", None, reason))

  @staticmethod
  def _deliver(request: Request, event: TokenEvent) -> TokenEvent:
    if request.on_event is not None:
      request.on_event(event)
    return event

  # -- the simple ways in --------------------------------------------------------------

  def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] = GREEDY) -> list[Completion]:
    """Complete every prompt (texts or token-id lists); one SamplingParams for all or one
    each. Returns Completions in prompt order."""
    settings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    requests = [self.submit(p, s) for p, s in zip(prompts, settings)]
    while any(r.finish_reason is None for r in requests):
      self.step()
    return [r.completion() for r in requests]

  def stream(self, prompt, sampling: SamplingParams = GREEDY) -> Iterator[TokenEvent]:
    """Yield TokenEvents for one prompt as they come (drives the engine itself)."""
    request = self.submit(prompt, sampling)
    while request.finish_reason is None:
      for event in self.step():
        if event.request_id == request.id:
          yield event
