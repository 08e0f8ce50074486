"""What `jaxpar serve` reports at /metrics, in Prometheus' text format.

Latencies are observed on the engine's thread as each token is produced (so they measure
the engines, not the HTTP loop): time to first token from arrival, and the gaps between a
request's tokens, over every replica. Each replica's engine state (queue, slots, KV pages,
prefix cache, preemptions), labelled by replica, is read when scraped. Each server has its own registry, so several can live in one process (tests).
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
  def __init__(self, engines):
    self.engines = engines
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
  """Gauges and counters read from each replica's engine at scrape time, labelled `replica`
  ("0" where one engine serves)."""

  def __init__(self, metrics: ServingMetrics):
    self.metrics = metrics

  def collect(self):
    engines = self.metrics.engines
    families = {}

    def add(kind, name, doc, values):
      family = families.setdefault(name, kind(name, doc, labels=["replica"]))
      for replica, value in enumerate(values):
        family.add_metric([str(replica)], value)
    gauge = lambda *args: add(GaugeMetricFamily, *args)  # noqa: E731
    counter = lambda *args: add(CounterMetricFamily, *args)  # noqa: E731
    stats = [e.stats for e in engines]
    pools = [e.pool for e in engines]
    queries = [s["prefix_cache_queries"] for s in stats]
    hits = [s["prefix_cache_hits"] for s in stats]
    gauge("jaxpar_requests_waiting", "Requests queued for a slot", [e.pending for e in engines])
    gauge("jaxpar_requests_running", "Slots holding a request", [sum(r is not None for r in e.slots) for e in engines])
    gauge("jaxpar_slots", "Slots decoded together", [len(e.slots) for e in engines])
    gauge("jaxpar_kv_pages_used", "KV cache pages in use", [p.num_pages - p.free for p in pools])
    gauge("jaxpar_kv_pages_free", "KV cache pages free (never used, or cached and held by nobody)",
          [p.free for p in pools])
    gauge("jaxpar_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up",
          [h / q if q else 0.0 for h, q in zip(hits, queries)])
    counter("jaxpar_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
    counter("jaxpar_prefix_cache_hits", "Prompt tokens found in the prefix cache", hits)
    gauge("jaxpar_kv_pages_cached", "KV pages indexed by the prefix cache (held or not)", [p.cached for p in pools])
    counter("jaxpar_prefix_cache_evictions", "Cached pages reused for other blocks", [p.evictions for p in pools])
    counter("jaxpar_prefill_tokens", "Prompt tokens computed by prefill", [s["prefill_tokens"] for s in stats])
    counter("jaxpar_preemptions", "Requests preempted for want of KV pages", [s["preemptions"] for s in stats])
    counter("jaxpar_engine_failures", "Engine steps that failed (their requests ended with the error)",
            [s["step_failures"] for s in stats])
    counter("jaxpar_kv_transfers", "Prompts whose KV pages moved here from a prefill engine",
            [s["kv_transfers"] for s in stats])
    counter("jaxpar_kv_transfer_bytes", "Bytes of KV pages moved here from a prefill engine",
            [s["kv_transfer_bytes"] for s in stats])
    counter("jaxpar_kv_transfer_seconds", "Seconds from gathering moved KV pages to their arrival",
            [s["kv_transfer_seconds"] for s in stats])
    if engines[0].draft is not None:
      rounds = [s["speculative_rounds"] for s in stats]
      accepted = [s["speculative_accepted"] for s in stats]
      counter("jaxpar_speculative_draft_tokens", "Draft tokens proposed", [s["speculative_proposed"] for s in stats])
      counter("jaxpar_speculative_accepted_tokens", "Draft tokens kept", accepted)
      counter("jaxpar_speculative_target_passes", "Rows checked by a target pass", rounds)
      gauge("jaxpar_speculative_tokens_per_pass", "Tokens generated per row per target pass",
            [(a + r) / r if r else 0.0 for a, r in zip(accepted, rounds)])
    yield from families.values()
    rate = GaugeMetricFamily("jaxpar_generation_tokens_per_second",
                             f"Tokens generated per second over the last {_RATE_WINDOW_S:.0f} s")
    rate.add_metric([], self.metrics.tokens_per_second())
    yield rate
