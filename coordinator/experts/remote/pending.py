"""A layer's calls in flight and their answers gathered: failover to other holders, the hedged race of a
stalled call, the twin answers of --verify pair, the rows written back in the packed order. What it asks of
the backend that sent the calls is `Failover`, not the backend itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import grpc
import torch

from swarm.coordinator.checks.twins import TwinAnswer
from swarm.coordinator.experts.backend import ExpertMajor
from swarm.coordinator.experts.remote.calls import Part, SentCall, WireRows, span
from swarm.coordinator.experts.turns import away
from swarm.node.client import NodeCallError, wait_calls

log = logging.getLogger(__name__)

# Failures that mean "this holder is gone or stuck": try another one. Anything else (a bad request) is a bug
# or a mismatch that another holder would answer the same way.
FAILOVER_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)


class Failover(Protocol):
    """What a layer's calls in flight need of the backend that sent them."""

    @property
    def timeout(self) -> float:
        """Seconds failover keeps trying holders of a layer's calls."""
        ...

    def send(
        self, layer: int, major: ExpertMajor, rows: WireRows, parts: list[Part], failed: dict[int, list[str]],
        deadline: float | None = None, dropped: list[Part] | None = None,
    ) -> list[SentCall]:  # fmt: skip
        """`parts` sent again to holders that have not failed them (`failed`: expert index -> addresses)."""
        ...

    def observed(self, c: SentCall) -> tuple[SentCall, torch.Tensor]:
        """(c, its answer), waited for, with the time its node took recorded."""
        ...

    def node_failed(self, address: str) -> None:
        """A call to this node failed: back off from it."""
        ...

    def hedge_after(self, c: SentCall) -> float | None:
        """Seconds to wait for c before asking another holder too; None: no estimate yet."""
        ...

    def hedge(self, layer: int, major: ExpertMajor, rows: WireRows, c: SentCall) -> list[SentCall]:
        """c's parts sent to other holders too (none where some expert of c has no other)."""
        ...

    def hedge_won(self, address: str) -> None:
        """Another holder answered before this stalled node: pass it over for a while."""
        ...

    def checked(self, c: SentCall, layer: int, major: ExpertMajor, answer: torch.Tensor) -> torch.Tensor:
        """c's answer as it is used: booked (and maybe audited) with the checker, replaced where caught."""
        ...

    def compare_twins(self, layer: int, answers: list[TwinAnswer]) -> None:
        """--verify pair: the parts of one call a second holder answered too, compared."""
        ...

    def left_out(self, pairs: int) -> None:
        """Degraded mode left this many (token, slot) pairs out of the sum."""
        ...

    def spare(self, waiting: Callable[[], bool]) -> None:
        """Time the model would only wait for a node (`waiting()` says whether it still would): answers
        booked earlier are checked meanwhile."""
        ...

    def waited(self, seconds: float) -> None:
        """The model was blocked this long on the nodes."""
        ...


class SwarmPending:
    """One layer's calls in flight; `wait` gathers their answers into [T, K, D]."""

    def __init__(
        self,
        failover: Failover,
        layer: int,
        major: ExpertMajor,
        rows: WireRows,
        calls: list[SentCall],
        t: int,
        k: int,
        device: torch.device,
        dropped: list[Part] | None = None,
        twins: list[SentCall] | None = None,
    ) -> None:
        """`dropped`: parts no live node holds (degraded mode); `twins`: the same parts sent to second
        holders (--verify pair)."""
        self.failover, self.layer, self.major = failover, layer, major
        self.wire, self.rows = rows, rows.values  # (failover and hedges send the same rows again)
        self.calls, self.t, self.k, self.device = calls, t, k, device
        self._dropped: list[Part] = list(dropped or [])
        self.twins: list[SentCall] = list(twins or [])
        self.dropped: torch.Tensor | None = None  # [T, K] True where a pair was left out (degraded mode)

    def wait(self) -> torch.Tensor:
        f, g = self.failover, self.major
        offsets = g.offsets()
        out = torch.empty(self.rows.shape, dtype=torch.float32)
        pending = list(self.calls)
        failed: dict[int, list[str]] = {}  # expert index -> holders that failed it, in order
        deadline = time.monotonic() + f.timeout  # failover keeps trying holders until then
        by_row: list[str] = [""] * int(self.rows.shape[0]) if self.twins else []  # who answered each row
        spare = True
        while pending:
            c = pending.pop(0)
            if spare and not c.call.done():  # once a layer: the earlier layers' answers, in one batch
                spare = False
                f.spare(lambda c=c: not c.call.done())
            try:
                answers = self._answer(c)
            except NodeCallError as e:
                if e.code not in FAILOVER_CODES:
                    raise
                log.warning("node %s failed layer %d (%s); trying other holders", c.address, self.layer, e)
                f.node_failed(c.address)
                for i in {p.index for p in c.parts}:
                    failed.setdefault(i, []).append(c.address)
                pending.extend(f.send(self.layer, g, self.wire, c.parts, failed, deadline, self._dropped))
                continue
            for call, result in answers:
                result = f.checked(call, self.layer, g, result)
                begins = [offsets[p.index] + p.start for p in call.parts]
                for begin, p in zip(begins, call.parts, strict=True) if by_row else ():
                    by_row[begin : begin + p.rows] = [call.address] * p.rows
                end = span(begins, call.parts)
                if end is not None:
                    out[begins[0] : end].copy_(result)  # one copy for the whole answer
                    continue
                at = 0
                for begin, p in zip(begins, call.parts, strict=True):
                    out[begin : begin + p.rows].copy_(result[at : at + p.rows])
                    at += p.rows
        if self.twins:
            self._compare_twins(out, by_row)
        if self._dropped:
            mask = torch.zeros(self.rows.shape[0], 1)
            for p in self._dropped:
                begin = offsets[p.index] + p.start
                out[begin : begin + p.rows] = 0.0
                mask[begin : begin + p.rows] = 1.0
            self.dropped = g.unpack(mask, self.t, self.k)[..., 0].bool().to(self.device)  # [T, K]
            f.left_out(sum(p.rows for p in self._dropped))
            experts = sorted({g.expert_ids[p.index] for p in self._dropped})
            log.warning(
                "degraded: layer %d experts %s have no live holder; left out of the sum", self.layer, experts
            )
        return g.unpack(out.to(self.device), self.t, self.k)

    def _compare_twins(self, out: torch.Tensor, by_row: list[str]) -> None:
        """Each second holder's answer beside the first's, part by part, handed back to be compared. A second
        holder that fails leaves the first's answer to the sampled audits."""
        offsets = self.major.offsets()
        for twin in self.twins:
            try:
                _, answer = self.failover.observed(twin)
            except NodeCallError as e:
                log.warning("node %s failed a twin call of layer %d (%s)", twin.address, self.layer, e)
                self.failover.node_failed(twin.address)
                continue
            at, answers = 0, []
            for p in twin.parts:
                begin = offsets[p.index] + p.start
                theirs, at = answer[at : at + p.rows], at + p.rows
                first = out[begin : begin + p.rows].to(theirs.dtype)  # (exact: out holds the wire's values)
                rows = self.rows[begin : begin + p.rows]
                expert = self.major.expert_ids[p.index]
                answers.append(TwinAnswer(expert, rows, by_row[begin], first, twin.address, theirs))
            self.failover.compare_twins(self.layer, answers)

    def _answer(self, c: SentCall) -> list[tuple[SentCall, torch.Tensor]]:
        """The rows of call c: from c itself or, when c stalls, from hedge calls to other holders."""
        f = self.failover
        after = f.hedge_after(c)
        if after is None or c.call.wait(after):
            return [f.observed(c)]
        hedges = f.hedge(self.layer, self.major, self.wire, c)
        if not hedges:
            return [f.observed(c)]
        log.info("node %s has not answered layer %d in %.2f s; asked %s too", c.address, self.layer, after,
                 ", ".join(sorted({h.address for h in hedges})))  # fmt: skip
        while not c.call.done() and not all(h.call.done() for h in hedges):
            wait_calls([c.call, *(h.call for h in hedges if not h.call.done())])
        if c.call.succeeded():
            return [f.observed(c)]
        try:
            won = [f.observed(h) for h in hedges]  # waits for the rest of them
        except NodeCallError:
            return [f.observed(c)]  # the hedges failed too: the original decides (answer or failover)
        f.hedge_won(c.address)
        log.warning(
            "node %s stalled on layer %d; its replicas answered, passing it over", c.address, self.layer
        )
        return won


class TimedPending:
    """Counts the time the model spends blocked on the swarm (what overlapping did not hide)."""

    in_flight = True  # the nodes compute until wait(): what the model does meanwhile overlaps them

    def __init__(self, failover: Failover, inner: SwarmPending) -> None:
        self.failover, self.inner = failover, inner

    @property
    def dropped(self) -> torch.Tensor | None:
        return self.inner.dropped

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            with away():  # another group of the pass computes meanwhile (experts.turns)
                return self.inner.wait()
        finally:
            self.failover.waited(time.perf_counter() - t0)
