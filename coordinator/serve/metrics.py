"""`swarm serve`'s /metrics, in Prometheus text format (prometheus-client): requests, tokens in and out,
tokens/s, time to first token, queue depth, and per node calls, rows, latency and failures."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from swarm.coordinator.serve.scheduler import Request, Scheduler

# seconds over which tokens/s is averaged
RATE_WINDOW = 10.0


class _NodeCollector(Collector):
    """Per-node figures read from the swarm backend at scrape time (it counts them as it calls)."""

    def __init__(self, experts: Any) -> None:
        self.experts = experts

    def collect(self) -> Iterator[Any]:
        e = self.experts
        calls = CounterMetricFamily("swarm_node_calls", "expert calls sent to each node", labels=["node"])
        rows = CounterMetricFamily("swarm_node_rows", "token-expert rows sent to each node", labels=["node"])
        seconds = CounterMetricFamily(
            "swarm_node_call_seconds", "seconds spent waiting on each node's answers", labels=["node"]
        )
        failures = CounterMetricFamily(
            "swarm_node_failures", "calls to each node that failed", labels=["node"]
        )
        up = GaugeMetricFamily(
            "swarm_node_up", "1 if the node takes calls now (not down, not banned)", labels=["node"]
        )
        live = set(e.placement.addresses())
        # copies: the engine thread goes on counting while this reads
        n_calls, n_rows = dict(e.calls_per_node), dict(e.rows_per_node)
        waited, failed = dict(e.seconds_per_node), dict(e.failures_per_node)
        for address in sorted(set(e.clients) | set(n_calls)):
            calls.add_metric([address], float(n_calls.get(address, 0)))
            rows.add_metric([address], float(n_rows.get(address, 0)))
            seconds.add_metric([address], float(waited.get(address, 0.0)))
            failures.add_metric([address], float(failed.get(address, 0)))
            up.add_metric([address], 1.0 if address in live else 0.0)
        yield from (calls, rows, seconds, failures, up)


class _DraftCollector(Collector):
    """Drafts checked and kept, decode passes and the tokens they made, over finished requests."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def collect(self) -> Iterator[Any]:
        t = dict(self.scheduler.draft_totals)
        for name, what in (
            ("drafted", "drafts checked in decode passes"),
            ("accepted", "drafts kept (equal to the model's own token)"),
            ("steps", "decode passes (a checking window or one token)"),
            ("tokens", "tokens those decode passes made"),
        ):
            yield CounterMetricFamily(f"swarm_serve_draft_{name}", what, value=float(t[name]))
        rate = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
        yield GaugeMetricFamily("swarm_serve_draft_accept_rate", "drafts kept / drafts checked", value=rate)
        per = t["tokens"] / t["steps"] if t["steps"] else 0.0
        yield GaugeMetricFamily("swarm_serve_tokens_per_pass", "tokens per decode pass", value=per)


class ServeMetrics:
    def __init__(self, experts: Any = None, scheduler: Scheduler | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "swarm_serve_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.tokens_in = Counter(
            "swarm_serve_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.tokens_cached = Counter(
            "swarm_serve_cached_prompt_tokens", "prompt tokens taken from a slot's held state", registry=r
        )
        self.tokens_out = Counter("swarm_serve_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "swarm_serve_time_to_first_token_seconds",
            "from a request's arrival to its first token",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.latency = Histogram(
            "swarm_serve_request_seconds", "from a request's arrival to its last token",
            buckets=(0.1, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r,
        )  # fmt: skip
        self.queue = Gauge("swarm_serve_queue_depth", "requests waiting for a slot", registry=r)
        self.active = Gauge("swarm_serve_active_slots", "slots with a request", registry=r)
        self.tps = Gauge(
            "swarm_serve_tokens_per_second",
            f"tokens generated per second over the last {RATE_WINDOW:g} s",
            registry=r,
        )
        if experts is not None and hasattr(experts, "placement"):
            r.register(_NodeCollector(experts))
        if scheduler is not None:
            r.register(_DraftCollector(scheduler))

    def request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def finished(self, req: Request, started: float, endpoint: str, count: bool = True) -> None:
        if count:
            self.request(endpoint, 200)
        self.tokens_in.inc(len(req.prompt))
        self.tokens_cached.inc(req.cached)
        self.tokens_out.inc(req.produced)
        if req.first_token is not None:
            self.ttft.observe(req.first_token - req.submitted)
        self.latency.observe(time.monotonic() - started)

    def render(self, scheduler: Scheduler) -> tuple[bytes, str]:
        self.queue.set(scheduler.queue_depth())
        self.active.set(scheduler.active())
        now = time.monotonic()
        recent = [(t, n) for t, n in list(scheduler.recent) if now - t <= RATE_WINDOW]
        self.tps.set(sum(n for _, n in recent) / RATE_WINDOW if recent else 0.0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
