"""Prometheus metrics: request counters and latency histograms of this server, and the scheduler's gauges.

Each app has its own registry (several apps may live in one test process). The scheduler's figures are
read from the latest `Pong` at scrape time, so they cost nothing between scrapes. With several server
processes (`server_processes > 1`) the launcher sets PROMETHEUS_MULTIPROC_DIR: every process then writes its
counters and histograms to files there and a scrape of any of them answers with the sum over all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import multiprocess
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from infer_protocol.messages import SchedulerStats

from infer_server.scheduler_client import SchedulerClient

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class SchedulerCollector(Collector):
    """Gauges and counters taken from the scheduler's latest Pong."""

    def __init__(self, client: SchedulerClient) -> None:
        self._client = client

    def collect(self) -> Iterator[Metric]:
        pong = self._client.last_pong
        stats = pong.stats if pong is not None else SchedulerStats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("rustinfer_scheduler_ready", "1 while the scheduler and its worker are ready", 1.0 if self._client.ready else 0.0)
        yield gauge("rustinfer_num_requests_running", "Requests the scheduler is running", stats.num_running)
        yield gauge("rustinfer_num_requests_waiting", "Requests waiting in the scheduler's queue", stats.num_waiting)
        total = stats.num_total_blocks
        used = max(0, total - stats.num_free_blocks - stats.num_cached_blocks)
        yield gauge("rustinfer_kv_cache_usage_ratio", "Fraction of KV blocks held by running requests",
                    used / total if total else 0.0)
        yield gauge("rustinfer_kv_cache_total_blocks", "KV cache blocks in total", total)
        yield gauge("rustinfer_kv_cache_free_blocks", "KV cache blocks free", stats.num_free_blocks)
        yield gauge("rustinfer_kv_cache_cached_blocks", "KV cache blocks held only by the prefix cache",
                    stats.num_cached_blocks)
        yield counter("rustinfer_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
                      stats.prefix_cache_queries_tokens)
        yield counter("rustinfer_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache",
                      stats.prefix_cache_hits_tokens)
        yield counter("rustinfer_num_preemptions", "Requests preempted by the scheduler", stats.num_preemptions)
        yield counter("rustinfer_scheduler_steps", "Steps the scheduler has run", stats.num_steps)
        yield counter("rustinfer_worker_restarts", "Workers the scheduler adopted after the first (restarts)",
                      stats.worker_restarts)
        yield counter("rustinfer_scheduler_plans_held", "Plans held until shortly before the running step's end "
                      "(plan_slack_ms)", stats.plans_held)
        yield counter("rustinfer_scheduler_plans_held_past_step_end", "Held plans still held when the running step "
                      "ended: the device waited for them", stats.plans_held_past_step_end)
        for name, doc, value in (
            ("plan", "The scheduler planning a step", stats.plan_ms),
            ("apply", "The scheduler applying a step's result", stats.apply_ms),
            ("worker_launch", "The worker applying a plan, preparing its inputs and queueing the step",
             stats.worker_launch_ms),
            ("worker_step", "The worker from taking a plan to its result being ready (device time included)",
             stats.worker_step_ms),
        ):
            yield gauge(f"rustinfer_step_{name}_seconds", f"{doc}: moving average over the recent steps",
                        value / 1e3)


class ServerMetrics:
    def __init__(self, client: SchedulerClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter("rustinfer_http_requests", "HTTP requests by endpoint and status",
                                     ["method", "endpoint", "status"], registry=r)
        self.request_finished = Counter("rustinfer_request_success", "Sequences finished, by finish reason",
                                        ["endpoint", "finish_reason"], registry=r)
        self.request_errors = Counter("rustinfer_request_errors", "Generation requests that failed, by error code",
                                      ["endpoint", "code"], registry=r)
        self.prompt_tokens = Counter("rustinfer_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generation_tokens = Counter("rustinfer_generation_tokens", "Tokens generated", registry=r)
        def latency(name: str, doc: str) -> Histogram:
            return Histogram(f"rustinfer_{name}_seconds", doc, buckets=_LATENCY_BUCKETS, registry=r)

        self.ttft = latency("time_to_first_token", "Time to the first generated token")
        self.tpot = Histogram("rustinfer_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = latency("e2e_request_latency", "Submit to last token")
        self.queue_time = latency("request_queue_time",
                                  "Time a sequence waited in the scheduler's queue before its first step")
        client.add_queue_time_listener(self.queue_time.observe)
        # vLLM's request phases: TTFT = the server's hops + queue + prefill; e2e = TTFT + decode
        self.prefill_time = latency("request_prefill_time", "First scheduled step to the first token, at the scheduler")
        self.decode_time = latency("request_decode_time", "First token to the last")
        self.inference_time = latency("request_inference_time",
                                      "First scheduled step to the last token (prefill + decode)")
        self.inflight = Gauge("rustinfer_num_requests_inflight", "Generation requests open in this server", registry=r,
                              multiprocess_mode="livesum")
        if os.environ.get(MULTIPROC_ENV):
            # The metrics above write to the shared files; the exposition registry reads them all back.
            self.registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.registry)
        self.registry.register(SchedulerCollector(client))

    def render(self) -> bytes:
        return generate_latest(self.registry)
