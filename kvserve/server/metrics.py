"""Prometheus metrics of the server: ``kvserve:`` names, label ``model_name``.

Three sources feed one registry (per server, so tests can build many):

- engine state, read from ``EngineClient.stats()`` at scrape time by
  ``EngineStatsCollector`` (running / waiting requests, KV usage, prefix-cache
  queries and hits, preemptions; with the host KV tier its blocks, hits,
  bytes copied each way and copy seconds; with speculative decoding vLLM's
  ``spec_decode_*`` counters: verifications, proposed and accepted tokens,
  accepted tokens per proposal position);
- per-request timings and counts, observed by the HTTP layer as outputs
  arrive (``RequestTimer``): TTFT, inter-token latency, end-to-end latency,
  queue time, prompt and generation tokens, finished requests by reason,
  admission rejections by reason; per LoRA adapter (label ``lora_name``)
  finished requests, prompt and generated tokens;
- the process and the interpreter, by prometheus_client's standard
  collectors (``process_*``: CPU seconds, resident memory, open files;
  ``python_*``: version, garbage collections), without the prefix.

Bucket boundaries live here and nowhere else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.outputs import RequestOutput

PREFIX = "kvserve:"
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                     30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
REJECTION_REASONS = ("queue_full", "draining", "loading", "engine_dead")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

StatsSource = Callable[[], dict[str, Any] | None]


class EngineStatsCollector(Collector):
    """Engine gauges and counters, read fresh from the engine at each scrape."""

    def __init__(self, model_name: str, stats: StatsSource) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats() or {}
        gauges: tuple[tuple[str, str, str], ...] = (
            ("num_requests_running", "Requests in the running batch.", "num_requests_running"),
            ("num_requests_waiting", "Requests waiting to be scheduled.",
             "num_requests_waiting"),
            ("kv_cache_usage_perc", "Share of KV-cache blocks held by requests (0..1).",
             "kv_cache_usage"),
        )
        if "kv_host_blocks_total" in stats:
            gauges += HOST_TIER_GAUGES
        for name, doc, key in gauges:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(stats.get(key, 0)))
            yield gauge
        counters: tuple[tuple[str, str, str], ...] = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             "prefix_cache_queries"),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             "prefix_cache_hits"),
            ("num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions"),
        )
        if "kv_host_blocks_total" in stats:
            counters += HOST_TIER_COUNTERS
        if "spec_decode_num_drafts" in stats:
            counters += SPEC_DECODE_COUNTERS
        if "kv_transfer_bytes_sent" in stats or "kv_transfer_bytes_received" in stats:
            counters += KV_TRANSFER_COUNTERS
        for name, doc, key in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], float(stats.get(key, 0)))
            yield counter
        per_position = stats.get("spec_decode_num_accepted_tokens_per_pos")
        if per_position is not None:
            counter = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Verifications whose proposals up to this position were all accepted.",
                labels=["model_name", "position"])
            for position, value in enumerate(per_position):
                counter.add_metric([self.model_name, str(position)], float(value))
            yield counter


KV_TRANSFER_COUNTERS = (  # disaggregated prefill / decode (--kv-role)
    ("kv_transfer_bytes_sent", "KV bytes a prefill engine sent to decode engines.",
     "kv_transfer_bytes_sent"),
    ("kv_transfer_send_s", "Seconds a prefill engine spent sending KV.", "kv_transfer_send_s"),
    ("kv_transfer_bytes_received", "KV bytes a decode engine received.",
     "kv_transfer_bytes_received"),
    ("kv_transfer_receive_s", "Seconds a decode engine spent receiving KV (pulls' data).",
     "kv_transfer_receive_s"),
    ("kv_transfer_pulled_requests", "Requests whose prompt KV a decode engine pulled.",
     "kv_transfer_pulled_requests"),
    ("kv_transfer_recomputed_requests",
     "Requests a decode engine prefilled itself after a failed or impossible pull.",
     "kv_transfer_recomputed_requests"),
)
HOST_TIER_GAUGES = (
    ("kv_host_blocks_total", "Blocks of the host KV tier.", "kv_host_blocks_total"),
    ("kv_host_blocks_used", "Blocks of the host KV tier holding KV.", "kv_host_blocks_used"),
)
HOST_TIER_COUNTERS = (
    ("kv_host_cache_hits", "Prompt tokens found in the host KV tier (copied back).",
     "kv_host_cache_hits"),
    ("kv_host_offloaded_blocks", "Blocks copied to the host tier when evicted.",
     "kv_host_offloaded_blocks"),
    ("kv_host_swapped_blocks", "Blocks of preempted requests copied to the host tier.",
     "kv_host_swapped_blocks"),
    ("kv_host_onloaded_blocks", "Blocks copied back from the host tier.",
     "kv_host_onloaded_blocks"),
    ("kv_host_bytes_to_host", "Bytes copied from the device to the host tier.",
     "kv_host_bytes_to_host"),
    ("kv_host_bytes_to_device", "Bytes copied from the host tier to the device.",
     "kv_host_bytes_to_device"),
    ("kv_host_copy_to_host_seconds", "Device time of the copies to the host tier.",
     "kv_host_copy_to_host_s"),
    ("kv_host_copy_to_device_seconds", "Device time of the copies from the host tier.",
     "kv_host_copy_to_device_s"),
)
SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "Verifications of proposals (one request, one step).",
     "spec_decode_num_drafts"),
    ("spec_decode_num_draft_tokens", "Proposed tokens verified.",
     "spec_decode_num_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
     "spec_decode_num_accepted_tokens"),
)


class ServerMetrics:
    """The registry and the request-level metrics of one server."""

    def __init__(self, model_name: str, stats: StatsSource) -> None:
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(model_name, stats))
        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(standard)
        labels = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self.request_success = counter(
            "request_success", "Finished completions (one per choice) by finish reason.",
            ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.lora_requests = counter(
            "lora_requests", "Finished completions (one per choice) per LoRA adapter.",
            ("lora_name",))
        self.lora_prompt_tokens = counter(
            "lora_prompt_tokens", "Prompt tokens of finished requests per LoRA adapter.",
            ("lora_name",))
        self.lora_generation_tokens = counter(
            "lora_generation_tokens", "Generated tokens per LoRA adapter.", ("lora_name",))
        self.admission_rejections = counter(
            "admission_rejections", "Requests refused with 503 before admission, by reason.",
            ("reason",))
        self.ttft = histogram("time_to_first_token_seconds",
                              "Arrival to first generated token.", TTFT_BUCKETS_S)
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two engine outputs of a request.", ITL_BUCKETS_S)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Arrival to the last output of a request.", REQUEST_BUCKETS_S)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival in the engine to first scheduling.",
                                    REQUEST_BUCKETS_S)
        # every series exists (at 0) from the first scrape
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for reason in REJECTION_REASONS:
            self.admission_rejections.labels(model_name, reason)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                       self.e2e, self.queue_time):
            metric.labels(model_name)

    def reject(self, reason: str) -> None:
        self.admission_rejections.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, num_choices: int, lora_name: str | None = None) -> RequestTimer:
        return RequestTimer(self, num_choices, lora_name)


class RequestTimer:
    """Observes one HTTP request (possibly several prompts) as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics, num_choices: int,
                 lora_name: str | None = None) -> None:
        self.metrics = metrics
        self.name = metrics.model_name
        self.lora_name = lora_name  # the adapter the request runs with, if any
        self.start_s = time.monotonic()
        self.num_choices = num_choices
        self._num_counted = 0
        self._last_s: dict[str, float] = {}

    def observe(self, output: RequestOutput) -> None:
        """Call once per ``RequestOutput`` received."""
        now = time.monotonic()
        num_new = sum(len(c.delta_token_ids) for c in output.outputs)
        if num_new:
            self.metrics.generation_tokens.labels(self.name).inc(num_new)
            if self.lora_name is not None:
                self.metrics.lora_generation_tokens.labels(self.name, self.lora_name).inc(
                    num_new)
            last_s = self._last_s.get(output.request_id)
            if last_s is None:
                self.metrics.ttft.labels(self.name).observe(now - self.start_s)
            else:
                self.metrics.itl.labels(self.name).observe(now - last_s)
            self._last_s[output.request_id] = now
        if output.finished:
            self._finish(output, now)

    def _finish(self, output: RequestOutput, now: float) -> None:
        self.metrics.e2e.labels(self.name).observe(now - self.start_s)
        queue_s = output.metrics.queue_s
        if queue_s is not None:
            self.metrics.queue_time.labels(self.name).observe(max(queue_s, 0.0))
        self.metrics.prompt_tokens.labels(self.name).inc(len(output.prompt_token_ids))
        if self.lora_name is not None:
            self.metrics.lora_prompt_tokens.labels(self.name, self.lora_name).inc(
                len(output.prompt_token_ids))
        for completion in output.outputs:
            self._count(completion.finish_reason or "abort", 1)

    def _count(self, reason: str, num: int) -> None:
        num = min(num, self.num_choices - self._num_counted)
        if num > 0:
            self.metrics.request_success.labels(self.name, reason).inc(num)
            if self.lora_name is not None:
                self.metrics.lora_requests.labels(self.name, self.lora_name).inc(num)
            self._num_counted += num

    def close(self, reason: str | None) -> None:
        """Count the choices that did not finish normally (client gone: "abort",
        engine failure: "error"; None: a rejected request, not counted); later
        calls count nothing."""
        if reason is None:
            self._num_counted = self.num_choices
        else:
            self._count(reason, self.num_choices - self._num_counted)
