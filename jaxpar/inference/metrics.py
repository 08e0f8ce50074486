"""What `jaxpar serve` reports at /metrics, in Prometheus' text format.

Latencies are observed on the engine's thread as each token is produced (so they measure
the engine, not the HTTP loop): time to first token from arrival, and the gaps between a
request's tokens. Engine state (queue, slots, KV pages, prefix cache, preemptions) is read
when scraped. Each server has its own registry, so several can live in one process (tests).
"""

import collections
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_RATE_WINDOW_S = 10.0


class ServingMetrics:
  def __init__(self, engine):
    self.engine = engine
    self.registry = CollectorRegistry()
    self.ttft = Histogram("jaxpar_time_to_first_token_seconds", "Time from arrival to the first generated token",
                          buckets=_LATENCY_BUCKETS, registry=self.registry)
    self.itl = Histogram("jaxpar_inter_token_latency_seconds", "Time between a request's successive tokens",
                         buckets=_LATENCY_BUCKETS, registry=self.registry)
    self.generated = Counter("jaxpar_generation_tokens", "Tokens generated", registry=self.registry)
    self.prompt = Counter("jaxpar_prompt_tokens", "Prompt tokens of admitted requests", registry=self.registry)
    self.finished = Counter("jaxpar_requests_finished", "Requests finished, by reason", ["finish_reason"],
                            registry=self.registry)
    self._recent = collections.deque()  # times of recent tokens, for tokens/s
    self._last: dict[int, float] = {}  # each running request's latest token time
    self._lock = threading.Lock()
    self.registry.register(_EngineState(self))

  def admitted(self, prompt_tokens: int):
    self.prompt.inc(prompt_tokens)

  def observe(self, request, event):
    """One TokenEvent of `request` (called on the engine's thread)."""
    now = time.monotonic()
    if event.token is not None:
      last = self._last.get(request.id)
      if last is None:
        self.ttft.observe(now - request.arrival)
      else:
        self.itl.observe(now - last)
      self._last[request.id] = now
      self.generated.inc()
      with self._lock:
        self._recent.append(now)
    if event.finish_reason is not None:
      self._last.pop(request.id, None)
      self.finished.labels(event.finish_reason).inc()

  def tokens_per_second(self) -> float:
    now = time.monotonic()
    with self._lock:
      while self._recent and self._recent[0] < now - _RATE_WINDOW_S:
        self._recent.popleft()
      return len(self._recent) / _RATE_WINDOW_S

  def exposition(self) -> bytes:
    return generate_latest(self.registry)


class _EngineState:
  """Gauges and counters read from the engine at scrape time."""

  def __init__(self, metrics: ServingMetrics):
    self.metrics = metrics

  def collect(self):
    engine = self.metrics.engine
    stats, pool = engine.stats, engine.pool

    def gauge(name, doc, value):
      family = GaugeMetricFamily(name, doc)
      family.add_metric([], value)
      return family

    def counter(name, doc, value):
      family = CounterMetricFamily(name, doc)
      family.add_metric([], value)
      return family
    queries, hits = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
    yield gauge("jaxpar_requests_waiting", "Requests queued for a slot", engine.pending)
    yield gauge("jaxpar_requests_running", "Slots holding a request", sum(r is not None for r in engine.slots))
    yield gauge("jaxpar_slots", "Slots decoded together", len(engine.slots))
    yield gauge("jaxpar_kv_pages_used", "KV cache pages in use", pool.num_pages - pool.free)
    yield gauge("jaxpar_kv_pages_free", "KV cache pages free (never used, or cached and held by nobody)", pool.free)
    yield gauge("jaxpar_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up",
                hits / queries if queries else 0.0)
    yield counter("jaxpar_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
    yield counter("jaxpar_prefix_cache_hits", "Prompt tokens found in the prefix cache", hits)
    yield gauge("jaxpar_kv_pages_cached", "KV pages indexed by the prefix cache (held or not)", pool.cached)
    yield counter("jaxpar_prefix_cache_evictions", "Cached pages reused for other blocks", pool.evictions)
    yield counter("jaxpar_prefill_tokens", "Prompt tokens computed by prefill", stats["prefill_tokens"])
    yield counter("jaxpar_preemptions", "Requests preempted for want of KV pages", stats["preemptions"])
    if engine.draft is not None:
      rounds = stats["speculative_rounds"]
      yield counter("jaxpar_speculative_draft_tokens", "Draft tokens proposed", stats["speculative_proposed"])
      yield counter("jaxpar_speculative_accepted_tokens", "Draft tokens kept", stats["speculative_accepted"])
      yield counter("jaxpar_speculative_target_passes", "Rows checked by a target pass", rounds)
      yield gauge("jaxpar_speculative_tokens_per_pass", "Tokens generated per row per target pass",
                  (stats["speculative_accepted"] + rounds) / rounds if rounds else 0.0)
    yield gauge("jaxpar_generation_tokens_per_second", f"Tokens generated per second over the last "
                f"{_RATE_WINDOW_S:.0f} s", self.metrics.tokens_per_second())
