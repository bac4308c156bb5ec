"""A node's Prometheus metrics (`swarm node --metrics-port`): read from its call statistics when scraped.

The servicer already counts what it does (swarm.node.server.CallStats); a collector turns those counters into
Prometheus families on each scrape, so nothing is counted twice and serving pays nothing for metrics.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from swarm.compute.store import ExpertStore
from swarm.node.server import CallStats


class NodeCollector(Collector):
    def __init__(self, stats: CallStats, store: ExpertStore, name: str) -> None:
        self.stats, self.store, self.name = stats, store, name

    def collect(self) -> Iterator[Any]:
        s, labels = self.stats, [self.name]
        with s.lock:
            calls, rows, errors, busy, in_flight = s.calls, s.rows, s.errors, s.busy_seconds, s.in_flight
            per_layer: dict[int, list[int]] = {}
            for (layer, _), (c, r) in s.per_expert.items():
                acc = per_layer.setdefault(layer, [0, 0])
                acc[0] += c
                acc[1] += r
        cache = self.store.cache_stats()
        for metric, doc, value in (
            ("swarm_node_calls", "Compute calls answered", calls),
            ("swarm_node_rows", "rows computed", rows),
            ("swarm_node_errors", "Compute calls refused or failed", errors),
            ("swarm_node_busy_seconds", "summed compute time of the calls", busy),
            ("swarm_node_cache_hits", "experts found as float32 working copies (exact numerics)", cache.hits),
            ("swarm_node_cache_misses", "experts dequantized for a call (exact numerics)", cache.misses),
        ):
            c = CounterMetricFamily(metric, doc, labels=["node"])
            c.add_metric(labels, value)
            yield c
        g = GaugeMetricFamily("swarm_node_in_flight", "Compute calls being computed now", labels=["node"])
        g.add_metric(labels, in_flight)
        yield g
        g = GaugeMetricFamily("swarm_node_slabs", "expert slabs this node serves", labels=["node"])
        g.add_metric(labels, len(self.store.slabs))
        yield g
        g = GaugeMetricFamily(
            "swarm_node_slabs_dropped",
            "expert slabs no longer served: their files failed the check",
            labels=["node"],
        )
        g.add_metric(labels, len(self.store.dropped()))
        yield g
        g = GaugeMetricFamily("swarm_node_cache_bytes", "bytes of float32 working copies", labels=["node"])
        g.add_metric(labels, cache.resident_bytes)
        yield g
        c = CounterMetricFamily(
            "swarm_node_layer_rows", "rows computed per MoE layer", labels=["node", "layer"]
        )
        for layer, (_, r) in sorted(per_layer.items()):
            c.add_metric([self.name, str(layer)], r)
        yield c


def serve_metrics(stats: CallStats, store: ExpertStore, name: str, host: str, port: int) -> tuple[Any, int]:
    """Start the /metrics HTTP endpoint on host:port (0: any free port); (server, the port it got)."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(stats, store, name))
    server, thread = start_http_server(port, addr=host, registry=registry)
    assert isinstance(thread, threading.Thread)
    return server, int(server.server_port)
