"""What `swarm serve`'s /swarm page and /swarm.json show, gathered from what the server already knows: the
swarm backend's placement, audit report and call counts, the scheduler's slots and queue, the metrics'
counters, and each node's own Info and Stats.

A thread of its own (never the engine's) samples tokens/s and time to first token once a second for the
charts, and while someone looks (a read of /swarm.json in the last WATCHED_SECONDS) asks every node for its
Stats on a client of its own, so that a node that stops answering shows as down within a poll or two even
when no request is running to find it out. It adds nothing to the engine thread's work.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from swarm.coordinator.experts.backend import RoutingStats
from swarm.coordinator.serve import swarm_view
from swarm.coordinator.serve.metrics import RATE_WINDOW, ServeMetrics
from swarm.coordinator.serve.scheduler import Scheduler
from swarm.node.client import NodeCallError, NodeClient
from swarm.sharding.ranges import format_slabs
from swarm.sharding.slabs import SlabKey

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
STATS_TIMEOUT = 1.5  # a node slower than this to say its Stats counts as down for the poll
INFO_EVERY = 10  # polls between two reads of a node's Info (what it holds changes while it fetches)
WATCHED_SECONDS = 30.0
HISTORY_POINTS = 300  # one a second: the charts' last five minutes


@dataclass
class _Seen:
    """One node as the last polls found it."""

    info: Any = None
    stats: Any = None
    at: float = 0.0
    recent: tuple[float, float | None] | None = None
    error: str | None = None  # the last poll's failure (gRPC status), None when it answered
    polls: int = 0


class SwarmWatch:
    def __init__(self, engine: Any, scheduler: Scheduler, metrics: ServeMetrics, model_id: str) -> None:
        self.experts, self.model, self.source = engine.experts, engine.model, engine.source
        self.scheduler, self.metrics, self.model_id = scheduler, metrics, model_id
        self.swarm = hasattr(self.experts, "placement")
        self.needed: list[SlabKey] = list(self.experts.needed if self.swarm else self.experts.store.held())
        self._layer_bytes: dict[int, int] | None = None
        self._seen: dict[str, _Seen] = {}
        self._clients: dict[str, NodeClient] = {}
        self._lock = threading.Lock()
        self._history: deque[tuple[float, float, float | None, int, int]] = deque(maxlen=HISTORY_POINTS)
        self._viewed = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-watch", daemon=True)

    def start(self) -> SwarmWatch:
        self._thread.start()
        atexit.register(self.close)
        return self

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    # ---- what /swarm.json answers (on the event loop: in-memory reads only) ----

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._viewed > WATCHED_SECONDS:
            self._wake.set()  # nobody looked for a while: poll the nodes now rather than in a second
        self._viewed = now
        if self._layer_bytes is None:
            self._layer_bytes = swarm_view.layer_slab_bytes(self.source)
        nodes, holders = self._nodes() if self.swarm else ([], dict.fromkeys(self.needed, 1))
        counts, source = self._routing()
        out = swarm_view.snapshot(self.source, nodes, self.needed, holders, counts, source)
        out["server"] = self._server(now)
        out["requests"] = self._requests(now)
        out["history"] = self._history_now(time.time())
        return out

    def _nodes(self) -> tuple[list[dict[str, Any]], dict[SlabKey, int]]:
        e = self.experts
        placement = e.placement
        every = placement.holders()
        holding = {a for hs in every.values() for a in hs}
        routable = set(placement.addresses())  # holders neither banned nor backing off
        report = e.auditor.report if e.auditor is not None else None
        banned = dict(report.banned) if report is not None else {}
        passed = getattr(report, "passed", None)  # per-node passed audits, where the auditor counts them
        with self._lock:
            seen = dict(self._seen)
        records, state_of = [], {}
        for address in sorted(set(e.clients) | holding):
            s = seen.get(address) or _Seen()
            if address in banned or placement.is_banned(address):
                state = "banned"
            elif s.error is not None:
                state = "down"
            elif address not in holding:
                state = "left"
            elif address not in routable:
                state = "backoff"
            else:
                state = "up"
            state_of[address] = state
            why = banned.get(address) or ("caught answering wrong" if state == "banned" else None)
            records.append(swarm_view.node_record(
                address, s.info, s.stats, answering=s.error is None and s.info is not None, error=s.error,
                state=state, answers="-" if report is None else ("BANNED" if why else "ok"),
                banned_because=why, audits_passed=passed.get(address, 0) if passed is not None else None,
                recent=s.recent, layer_bytes=self._layer_bytes,
            ))  # fmt: skip
            if s.info is None and e.classes.get(address):
                records[-1]["numerics_class"] = e.classes[address]  # from its mDNS record, before Info comes
            if s.info is None:
                mine = sorted(k for k, hs in every.items() if address in hs)
                records[-1].update(held=format_slabs(mine), slabs=len(mine))
        holders = {k: sum(1 for a in hs if state_of.get(a) == "up") for k, hs in every.items()}
        return records, holders

    def _routing(self) -> tuple[dict[SlabKey, int] | None, str]:
        """How often each expert was used: the router's own counts where `--stats` records them, else the
        rows the nodes say each expert got; None in process without --stats."""
        for m in self.model.modules():
            inner = getattr(m, "experts", None)
            if isinstance(inner, RoutingStats):
                for _ in range(3):  # the engine thread adds keys while this copies
                    try:
                        return dict(inner.counts), "router"
                    except RuntimeError:
                        continue
                return None, "router"
        if not self.swarm:
            return None, "router"
        with self._lock:
            stats = [s.stats for s in self._seen.values()]
        return dict(swarm_view.routing_from_nodes(stats)), "nodes"

    def _server(self, now: float) -> dict[str, Any]:
        sched = self.scheduler
        recent = [(t, n) for t, n in list(sched.recent) if now - t <= RATE_WINDOW]
        out: dict[str, Any] = {
            "model_id": self.model_id,
            "in_process": not self.swarm,
            "slots": len(sched.slots),
            "active": sched.active(),
            "queued": sched.queue_depth(),
            "ctx_size": sched.ctx_size,
            "tokens_per_second": sum(n for _, n in recent) / RATE_WINDOW,
            "checks": None,
        }
        if self.swarm:
            e = self.experts
            report = e.auditor.report if e.auditor is not None else None
            out["checks"] = {
                "audits": report.audits if report else 0, "probes": report.probes if report else 0,
                "banned": len(report.banned) if report else 0, "failovers": e.failovers, "hedges": e.hedges,
                "paired_calls": e.twin_calls, "answers_checked": report is not None,
            }  # fmt: skip
        return out

    def _requests(self, now: float) -> list[dict[str, Any]]:
        """The requests in slots and in the queue (read without the scheduler's lock: a moment's view)."""
        out = []
        for s in list(self.scheduler.slots):
            r = s.request
            if r is None:
                continue
            out.append({
                "slot": s.index, "state": "reading" if s.fed < len(r.prompt) else "decoding",
                "prompt_tokens": len(r.prompt), "cached_tokens": r.cached, "read_tokens": s.fed,
                "generated": r.produced, "max_tokens": r.params.max_tokens, "seconds": now - r.submitted,
                "ttft_seconds": r.first_token - r.submitted if r.first_token is not None else None,
            })  # fmt: skip
        for r in list(self.scheduler.waiting):
            out.append({"slot": None, "state": "queued", "prompt_tokens": len(r.prompt), "cached_tokens": 0,
                        "read_tokens": 0, "generated": 0, "max_tokens": r.params.max_tokens,
                        "seconds": now - r.submitted, "ttft_seconds": None})  # fmt: skip
        return out

    def _history_now(self, wall: float) -> dict[str, Any]:
        with self._lock:
            points = list(self._history)
        return {
            "seconds_ago": [round(wall - p[0], 1) for p in points],
            "tokens_per_second": [p[1] for p in points],
            "ttft_seconds": [p[2] for p in points],
            "active": [p[3] for p in points],
            "queued": [p[4] for p in points],
        }

    # ---- the watch thread ----

    def _run(self) -> None:
        pool = ThreadPoolExecutor(8, thread_name_prefix="swarm-watch-poll")
        last, ttft_last = time.monotonic(), self._ttft_totals()
        try:
            while not self._stop.is_set():
                self._wake.wait(POLL_SECONDS)
                self._wake.clear()
                now = time.monotonic()
                ttft = self._ttft_totals()
                self._sample(last, now, ttft_last, ttft)
                last, ttft_last = now, ttft
                if self.swarm and now - self._viewed <= WATCHED_SECONDS:
                    self._poll(pool)
        except Exception:  # the page goes stale; serving goes on
            log.exception("the /swarm watch stopped")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _sample(
        self, last: float, now: float, ttft_last: tuple[float, float], ttft: tuple[float, float]
    ) -> None:
        tokens = sum(n for t, n in list(self.scheduler.recent) if last < t <= now)
        n, total = ttft[0] - ttft_last[0], ttft[1] - ttft_last[1]
        point = (time.time(), tokens / max(now - last, 1e-3), total / n if n > 0 else None,
                 self.scheduler.active(), self.scheduler.queue_depth())  # fmt: skip
        with self._lock:
            self._history.append(point)

    def _ttft_totals(self) -> tuple[float, float]:
        """(requests, summed seconds) of the time-to-first-token histogram: the mean of those that finished
        between two samples is the difference's."""
        count = total = 0.0
        for family in self.metrics.ttft.collect():
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
        return count, total

    def _poll(self, pool: ThreadPoolExecutor) -> None:
        addresses = sorted(set(self.experts.clients))
        for address, seen in zip(addresses, pool.map(self._poll_one, addresses), strict=True):
            with self._lock:
                self._seen[address] = seen

    def _poll_one(self, address: str) -> _Seen:
        with self._lock:
            old = self._seen.get(address) or _Seen()
        client = self._clients.get(address)
        if client is None:
            theirs = self.experts.clients[address]
            client = self._clients[address] = NodeClient(
                address, fingerprint=theirs.fingerprint, key=self.experts.key, tls=theirs.tls
            )
        s = _Seen(old.info, old.stats, old.at, old.recent, None, old.polls + 1)
        try:
            if s.info is None or s.polls % INFO_EVERY == 0:
                s.info = client.info(timeout=STATS_TIMEOUT)
            stats, at = client.stats(timeout=STATS_TIMEOUT), time.monotonic()
        except NodeCallError as e:
            s.error, s.recent = e.code.name, None  # its last rates are no longer what it does
            return s
        if old.stats is not None and old.error is None:
            s.recent = swarm_view.recent_rates(old.stats, stats, at - old.at)
        s.stats, s.at = stats, at
        return s
