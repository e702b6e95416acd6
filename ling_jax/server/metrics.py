"""Prometheus metrics of the server (`GET /metrics`), on a registry of its own.

Why a collector for the engine numbers: `Engine.stats()` belongs to the driver thread, so the
driver publishes a snapshot after every step and the collector reads that snapshot at scrape time
(no locking, never a half-updated view); latencies and token counts are observed by the HTTP
side as events arrive. A registry per server keeps two servers in one process (tests, benchmarks)
from mixing their numbers.

Exposed (prefix `ling_jax_`): queue_depth, slots_running, slots_free, slots_total, pages_in_use,
pages_total, requests_in_flight, prompt_tokens_total, generation_tokens_total,
requests_total{finish_reason}, time_to_first_token_seconds, time_per_output_token_seconds,
e2e_request_latency_seconds, engine_steps_total, preemptions_total, prefix_cache_hit_rate,
prefix_cache_hits_total, prefix_cache_tokens_saved_total, spec_acceptance_length.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "ling_jax_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))


class EngineStatsCollector:
    """Gauges and counters from the driver's latest `Engine.stats()` snapshot."""

    def __init__(self, stats: Callable[[], dict], in_flight: Callable[[], int]):
        self._stats, self._in_flight = stats, in_flight

    def collect(self):
        s = self._stats()

        def gauge(name, doc, value):
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(value))
            return c

        yield gauge("queue_depth", "requests waiting for a slot", s["queue_depth"])
        yield gauge("slots_running", "slots holding a request", s["slots_in_use"])
        yield gauge("slots_free", "slots free", s["slots_total"] - s["slots_in_use"])
        yield gauge("slots_total", "slots of the engine", s["slots_total"])
        yield gauge("pages_in_use", "latent-cache pages held by requests", s["pages_in_use"])
        yield gauge("pages_total", "latent-cache pages of the pool", s["pages_total"])
        yield gauge("requests_in_flight", "engine requests admitted by the server and not finished",
                    self._in_flight())
        yield counter("engine_steps", "engine steps run", s["steps"])
        yield counter("preemptions", "requests preempted (recomputed later)", s["preemptions"])
        hits, saved = s.get("prefix_hits", 0), s.get("prefix_tokens_saved", 0)
        fed = s.get("prompt_tokens_fed", 0)
        yield counter("prefix_cache_hits", "requests that reused cached prefix pages", hits)
        yield counter("prefix_cache_tokens_saved", "prompt tokens not recomputed thanks to the prefix cache", saved)
        yield gauge("prefix_cache_hit_rate", "share of prompt tokens served from the prefix cache",
                    saved / (saved + fed) if saved + fed else 0.0)
        yield gauge("spec_acceptance_length", "mean tokens emitted per speculative verify step per slot "
                    "(0 without speculation)", s.get("spec_acceptance_length", 0.0))


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict], in_flight: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "tokens generated", registry=r)
        self.requests = Counter(P + "requests", "finished choices by finish reason", ["finish_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "mean time between tokens of a choice",
                              registry=r, buckets=_TOKEN_BUCKETS)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "arrival to last token", registry=r,
                             buckets=_LATENCY_BUCKETS)
        r.register(EngineStatsCollector(stats, in_flight))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
