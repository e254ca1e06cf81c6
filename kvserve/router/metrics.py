"""Prometheus metrics of ``kvserve router`` (``kvserve:router_`` names, label ``backend``).

Counters: requests sent to each backend, errors by kind (``connect``: not
reachable, ``refused``: a 503 / 429 before the request started, ``stream``:
the backend went away mid-response), routing decisions by reason
(``policy.Decision.reason``), prompt blocks matched by the prefix policy.
Gauges, read at scrape time: each backend's health, load and the router's
in-flight requests to it; the size of the prefix table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.router.backends import BackendPool

PREFIX = "kvserve:router_"
ERROR_KINDS = ("connect", "refused", "stream")
REASONS = ("round_robin", "least_load", "prefix_hit", "prefix_new", "load_fallback")


class BackendCollector(Collector):
    """Per-backend gauges, read from the pool at each scrape."""

    def __init__(self, pool: BackendPool, num_prefix_entries: Callable[[], int]) -> None:
        self.pool = pool
        self.num_prefix_entries = num_prefix_entries

    def collect(self) -> Iterator[Metric]:
        gauges = (
            ("backend_healthy", "1 while the backend takes requests.",
             lambda b: float(b.healthy)),
            ("backend_in_flight", "Requests the router has in flight on the backend.",
             lambda b: float(b.in_flight)),
            ("backend_load", "The load routing compares (requests, KV usage as tie-break).",
             lambda b: b.load),
        )
        for name, doc, read in gauges:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["backend"])
            for backend in self.pool.backends:
                gauge.add_metric([backend.url], read(backend))
            yield gauge
        entries = GaugeMetricFamily(PREFIX + "prefix_table_entries",
                                    "Block hashes the prefix policy remembers.")
        entries.add_metric([], float(self.num_prefix_entries()))
        yield entries


class RouterMetrics:
    """The router's registry."""

    def __init__(self, pool: BackendPool, num_prefix_entries: Callable[[], int]) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(BackendCollector(pool, num_prefix_entries))
        self.requests = Counter(PREFIX + "requests", "Requests sent to a backend.", ["backend"],
                                registry=self.registry)
        self.errors = Counter(PREFIX + "errors", "Backend failures by kind.",
                              ["backend", "kind"], registry=self.registry)
        self.decisions = Counter(PREFIX + "routing_decisions", "Routing decisions by reason.",
                                 ["backend", "reason"], registry=self.registry)
        self.prefix_matched_blocks = Counter(
            PREFIX + "prefix_matched_blocks",
            "Prompt blocks found in the prefix table when routing.", ["backend"],
            registry=self.registry)
        self.unavailable = Counter(PREFIX + "unavailable",
                                   "Requests answered 503 because no backend could take them.",
                                   registry=self.registry)
        for backend in pool.backends:
            self.requests.labels(backend.url)
            self.prefix_matched_blocks.labels(backend.url)
            for kind in ERROR_KINDS:
                self.errors.labels(backend.url, kind)

    def render(self) -> bytes:
        return generate_latest(self.registry)
