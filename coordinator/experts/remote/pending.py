"""A layer's calls in flight and their answers gathered: failover to other holders, the hedged race of a
stalled call, the paired answers of --verify pair, the rows written back in the packed order."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import grpc
import torch

from swarm.compute.numclass import same_class
from swarm.coordinator.checks.recompute import same_bits
from swarm.coordinator.decode.turns import away
from swarm.coordinator.experts.backend import ExpertMajor
from swarm.coordinator.experts.remote.calls import Part, SentCall, WireRows, span
from swarm.node.client import NodeCallError, wait_calls

if TYPE_CHECKING:
    from swarm.coordinator.experts.remote.dispatch import SwarmExperts

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


class SwarmPending:
    """One layer's calls in flight; `wait` gathers their answers into [T, K, D]."""

    def __init__(
        self,
        backend: SwarmExperts,
        layer: int,
        groups: ExpertMajor,
        rows: WireRows,
        calls: list[SentCall],
        t: int,
        k: int,
        device: torch.device,
    ) -> None:
        self.backend, self.layer, self.groups = backend, layer, groups
        self.wire, self.rows = rows, rows.values  # (failover and hedges send the same rows again)
        self.calls, self.t, self.k, self.device = calls, t, k, device
        self._dropped: list[Part] = []
        self.dropped: torch.Tensor | None = None  # [T, K] True where a pair was left out (degraded mode)
        self.twins: list[SentCall] = []  # the same parts sent to second holders (--verify pair)

    def drop(self, parts: list[Part]) -> None:
        self._dropped += parts

    def wait(self) -> torch.Tensor:
        g = self.groups
        offsets = g.offsets()
        out = torch.empty(self.rows.shape, dtype=torch.float32)
        pending = list(self.calls)
        failed: dict[int, list[str]] = {}  # expert index -> holders that failed it, in order
        deadline = time.monotonic() + self.backend.timeout  # failover keeps trying holders until then
        by_row: list[str] = [""] * int(self.rows.shape[0]) if self.twins else []  # who answered each row
        while pending:
            c = pending.pop(0)
            try:
                answers = self._answer(c)
            except NodeCallError as e:
                if e.code not in FAILOVER_CODES:
                    raise
                log.warning("node %s failed layer %d (%s); trying other holders", c.address, self.layer, e)
                self.backend.node_failed(c.address)
                for i in {p.index for p in c.parts}:
                    failed.setdefault(i, []).append(c.address)
                pending.extend(
                    self.backend.send(self.layer, g, self.wire, c.parts, failed, deadline, self._dropped)
                )
                continue
            for call, result in answers:
                auditor = self.backend.auditor
                if auditor is not None:
                    ids = [g.expert_ids[p.index] for p in call.parts]
                    result = auditor.answered(
                        call.address, self.layer, ids, [p.rows for p in call.parts], call.sent, result
                    )
                    if auditor.is_banned(call.address):
                        self.backend.placement.ban(call.address)
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
            self.backend.dropped_pairs += sum(p.rows for p in self._dropped)
            experts = sorted({g.expert_ids[p.index] for p in self._dropped})
            log.warning(
                "degraded: layer %d experts %s have no live holder; left out of the sum", self.layer, experts
            )
        return g.unpack(out.to(self.device), self.t, self.k)

    def _compare_twins(self, out: torch.Tensor, by_row: list[str]) -> None:
        """--verify pair: each second holder's answer against the first's, part by part; where they differ,
        the auditor recomputes the rows and bans whichever node is not honest (the settle then redoes the
        pass without it). A second holder that fails leaves the first's answer to the sampled audits."""
        b, g = self.backend, self.groups
        auditor = b.auditor
        assert auditor is not None
        offsets = g.offsets()
        for twin in self.twins:
            try:
                _, answer = b.observed(twin)
            except NodeCallError as e:
                log.warning("node %s failed a paired call of layer %d (%s)", twin.address, self.layer, e)
                b.node_failed(twin.address)
                continue
            at = 0
            for p in twin.parts:
                begin = offsets[p.index] + p.start
                theirs, at = answer[at : at + p.rows], at + p.rows
                first = out[begin : begin + p.rows].to(theirs.dtype)  # (exact: out holds the wire's values)
                if same_bits(first, theirs):
                    continue
                rows, experts = self.rows[begin : begin + p.rows], [g.expert_ids[p.index]] * p.rows
                held = [
                    auditor.decide(address, self.layer, experts, rows, said)
                    for address, said in ((by_row[begin], first), (twin.address, theirs))
                ]
                for address, ok in zip((by_row[begin], twin.address), held, strict=True):
                    if not ok:
                        b.placement.ban(address)
                if all(held) and same_class(
                    b.classes.get(by_row[begin], ""), b.classes.get(twin.address, "")
                ):
                    log.warning(
                        "nodes %s and %s, of one numerics class, disagree on layer %d expert %d within the "
                        "bound this coordinator (another class) can check: one of them is wrong, and neither "
                        "can be shown so here; a third holder of their class would tell",
                        by_row[begin], twin.address, self.layer, g.expert_ids[p.index],
                    )  # fmt: skip
            b.paired_calls += 1

    def _answer(self, c: SentCall) -> list[tuple[SentCall, torch.Tensor]]:
        """The rows of call c: from c itself or, when c stalls, from hedge calls to other holders."""
        b = self.backend
        after = b.hedge_after(c)
        if after is None or c.call.wait(after):
            return [b.observed(c)]
        hedges = b.hedge(self.layer, self.groups, self.wire, c)
        if not hedges:
            return [b.observed(c)]
        log.info("node %s has not answered layer %d in %.2f s; asked %s too", c.address, self.layer, after,
                 ", ".join(sorted({h.address for h in hedges})))  # fmt: skip
        while not c.call.done() and not all(h.call.done() for h in hedges):
            wait_calls([c.call, *(h.call for h in hedges if not h.call.done())])
        if c.call.succeeded():
            return [b.observed(c)]
        try:
            won = [b.observed(h) for h in hedges]  # waits for the rest of them
        except NodeCallError:
            return [b.observed(c)]  # the hedges failed too: the original decides (answer or failover)
        b.hedge_wins += 1
        b.placement.mark_down(c.address)
        log.warning(
            "node %s stalled on layer %d; its replicas answered, passing it over", c.address, self.layer
        )
        return won


class TimedPending:
    """Counts the time the model spends blocked on the swarm (what overlapping did not hide)."""

    in_flight = True  # the nodes compute until wait(): what the model does meanwhile overlaps them

    def __init__(self, backend: SwarmExperts, inner: SwarmPending) -> None:
        self.backend, self.inner = backend, inner

    @property
    def dropped(self) -> torch.Tensor | None:
        return self.inner.dropped

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            with away():  # another group of the pass computes meanwhile (coordinator.turns)
                return self.inner.wait()
        finally:
            self.backend.wait_seconds += time.perf_counter() - t0
