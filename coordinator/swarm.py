"""The swarm expert backend: a MoE layer's pairs fanned out to the nodes that hold their experts.

Dimension letters: T tokens, K selected experts per token, D model width, N = T*K pairs.
Per layer and step: group the pairs expert-major (counts -> offsets -> pack), split the experts by the
holder `Placement.pick` chooses, send one Compute call per node (several when its rows would make a
message over CALL_BYTES: a long prefill; see split_parts), all at once; the model computes its shared
expert meanwhile; `wait` writes each node's rows back at their packed offsets and unpacks to [T, K, D].
A node that fails (gone, deadline, refused) is marked down and its experts are sent again to another
holder; a node that stalls (no answer in a few times its usual time) is hedged: its call goes to another
holder too and the first complete answer is used. The weighted sum over K happens in the model, in slot
order, so the result never depends on which node answered first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from swarm.compute.numclass import numerics_class, same_class
from swarm.compute.numerics import Numerics
from swarm.compute.store import ROWS_PER_MATMUL
from swarm.coordinator.audit import Auditor, same_bits
from swarm.coordinator.experts import ExpertMajor, PendingExperts, group_expert_major
from swarm.node.auth import SwarmKey
from swarm.node.client import ComputeCall, NodeCallError, NodeClient, ask_peer, wait_calls
from swarm.sharding.errors import UserError
from swarm.sharding.identity import Match, ModelIdentity
from swarm.sharding.ranges import format_ranges
from swarm.sharding.slabs import SlabKey

if TYPE_CHECKING:
    from swarm.node.discovery import NodeBrowser

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


# A node that failed a call is passed over for a while, then tried again (it may have been restarted, or
# busy rather than gone): 0.5 s after its first failure, doubling with each failure in a row, at most 30 s.
# An answer resets it; a node back from a failure is probed again before its next pair (with an auditor).
DOWN_SECONDS = 0.5
MAX_DOWN_SECONDS = 30.0
# While every holder of an expert is down, how often to look again (until the call's --timeout).
RETRY_SECONDS = 0.05
# Hedging: a call still unanswered after HEDGE_FACTOR times what this node usually takes for that many rows
# (and at least HEDGE_AFTER_MIN s) is sent again to another holder of its experts, and the first complete
# answer is used: both compute the same rows in the same matmul blocks, so either gives the same bits. A node
# that loses the race this way is passed over like a failed one (a phone gone to sleep stalls rather than
# fails: its calls would otherwise wait for the whole --timeout).
HEDGE_FACTOR = 4.0
HEDGE_AFTER_MIN = 0.5
# After mDNS found holders for every expert, how long to keep listening for more (replicas).
MDNS_SETTLE_SECONDS = 0.3
# The most row bytes one Compute call carries: a long prefill goes to a node as several calls. Well under the
# wire's MAX_MESSAGE_BYTES (whatever D and the wire precision), and the node starts computing the first
# call while the next ones are still on their way.
CALL_BYTES = 16 * 1024 * 1024


class Placement:
    """Which live node holds each (layer, expert); the one place that picks a holder."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._holders: dict[SlabKey, list[str]] = {}
        self._down: dict[str, float] = {}  # address -> until when it is passed over
        self._banned: set[str] = set()  # caught computing wrong: never picked again
        self._failures: dict[str, int] = {}  # address -> failures in a row
        self._turns: dict[int, int] = {}  # layer -> its calls so far: the replicas of its experts take turns
        self._lock = threading.Lock()
        self._clock = clock

    def add(self, address: str, held: Iterable[SlabKey], revive: bool = True) -> None:
        """`address` holds `held` (too); `revive`: it is up now (a node that has just been found)."""
        with self._lock:
            if revive:
                self._down.pop(address, None)
            for key in held:
                holders = self._holders.setdefault(key, [])
                if address not in holders:
                    holders.append(address)
                    holders.sort()

    def drop(self, address: str, keys: Iterable[SlabKey]) -> None:
        """A node no longer holds these slabs (it dropped them: their files failed its own check)."""
        with self._lock:
            for key in keys:
                holders = self._holders.get(key)
                if holders and address in holders:
                    holders.remove(address)

    def remove(self, address: str) -> None:
        """A node that left: it holds nothing any more."""
        with self._lock:
            for holders in self._holders.values():
                if address in holders:
                    holders.remove(address)
            self._down.pop(address, None)

    def next_turn(self, layer: int) -> None:
        """A new call of this layer: its experts' replicas take the next turn."""
        self._turns[layer] = self._turns.get(layer, 0) + 1

    def holders(self) -> dict[SlabKey, list[str]]:
        with self._lock:
            return {k: list(v) for k, v in self._holders.items()}

    def ban(self, address: str) -> None:
        with self._lock:
            self._banned.add(address)

    def is_banned(self, address: str) -> bool:
        return address in self._banned

    def mark_down(self, address: str, seconds: float | None = None) -> None:
        """Pass the node over for a while: exponential backoff over its failures in a row."""
        with self._lock:
            n = self._failures[address] = self._failures.get(address, 0) + 1
            if seconds is None:
                seconds = min(MAX_DOWN_SECONDS, DOWN_SECONDS * 2 ** (n - 1))
            self._down[address] = self._clock() + seconds

    def mark_up(self, address: str) -> None:
        """The node answered: its failures are forgotten."""
        if address in self._failures:
            with self._lock:
                self._failures.pop(address, None)
                self._down.pop(address, None)

    def failures(self, address: str) -> int:
        return self._failures.get(address, 0)

    def _is_down(self, address: str) -> bool:
        until = self._down.get(address)
        return until is not None and self._clock() < until

    def addresses(self) -> list[str]:
        with self._lock:
            every = {a for hs in self._holders.values() for a in hs}
            return sorted(a for a in every if not self._is_down(a) and a not in self._banned)

    def pick(
        self, layer: int, expert: int, avoid: Iterable[str] = (), include_down: bool = False
    ) -> str | None:
        """A live holder of (layer, expert) not in `avoid`, or None. Replicas share the load by a fixed
        rule that rotates with each call of the layer (`next_turn`): over a run every holder of an expert gets an
        equal share of its pairs, the share `swarm plan` counts on, and within one call the choice is fixed."""
        live = self.live(layer, expert, avoid, include_down)
        if not live:
            return None
        return live[(layer * 31 + expert + self._turns.get(layer, 0)) % len(live)]

    def live(
        self, layer: int, expert: int, avoid: Iterable[str] = (), include_down: bool = False
    ) -> list[str]:
        """The holders of (layer, expert) not banned, not in `avoid` and (unless include_down) not down."""
        avoid = set(avoid)
        with self._lock:
            return [
                a
                for a in self._holders.get((layer, expert), ())
                if a not in avoid and a not in self._banned and (include_down or not self._is_down(a))
            ]

    def missing(self, needed: Iterable[SlabKey]) -> dict[int, list[int]]:
        """layer -> experts with no live holder."""
        out: dict[int, list[int]] = {}
        for layer, expert in sorted(needed):
            if self.pick(layer, expert) is None:
                out.setdefault(layer, []).append(expert)
        return out


def describe_missing(missing: dict[int, list[int]], source: str) -> str:
    lines = [f"layer {layer}: experts {format_ranges(es)}" for layer, es in sorted(missing.items())]
    shown = "; ".join(lines[:6]) + (f"; and {len(lines) - 6} more layers" if len(lines) > 6 else "")
    layer, es = next(iter(sorted(missing.items())))
    return (
        f"no node holds {shown}. Start nodes that cover them, e.g. "
        f"`swarm node {source} --layers {layer} --experts {format_ranges(es)}`, or run with --local"
    )


@dataclass(frozen=True)
class Part:
    """Rows [start, start + rows) of one expert's block in the packed rows."""

    index: int  # the expert's position in ExpertMajor.expert_ids
    start: int
    rows: int


@dataclass
class _Call:
    address: str
    parts: list[Part]  # in the order of the call's rows
    call: ComputeCall
    width: int  # D: the width of the rows sent, and of the answer expected
    sent: torch.Tensor  # the rows sent, for an audit of the answer


def split_parts(parts: Sequence[Part], max_rows: int, unit: int = ROWS_PER_MATMUL) -> list[list[Part]]:
    """Parts as calls of at most max_rows rows, in order. An expert's block is never cut when it fits in
    one call; a bigger one is cut at multiples of `unit` from its start (so that a node multiplies the same
    row blocks as the in-process store) and may then exceed max_rows by up to one unit."""
    step = max(unit, max_rows // unit * unit)
    calls: list[list[Part]] = []
    room = 0
    for p in parts:
        if p.rows > room and p.rows <= max_rows:
            calls.append([])
            room = max_rows
        if p.rows <= room:
            calls[-1].append(p)
            room -= p.rows
            continue
        for at in range(0, p.rows, step):
            n = min(step, p.rows - at)
            calls.append([Part(p.index, p.start + at, n)])
            room = max(0, max_rows - n)
    return calls


def _span(begins: Sequence[int], parts: Sequence[Part]) -> int | None:
    """Where the parts' rows end when they lie back to back from begins[0] (a node holding a range of
    experts gets its experts' blocks so, in the packed order), else None."""
    end = begins[0]
    for b, p in zip(begins, parts, strict=True):
        if b != end:
            return None
        end = b + p.rows
    return end


class _SwarmPending:
    def __init__(
        self,
        backend: SwarmExperts,
        layer: int,
        groups: ExpertMajor,
        rows: torch.Tensor,
        calls: list[_Call],
        t: int,
        k: int,
        device: torch.device,
    ) -> None:
        self.backend, self.layer, self.groups, self.rows = backend, layer, groups, rows
        self.calls, self.t, self.k, self.device = calls, t, k, device
        self._dropped: list[Part] = []
        self.dropped: torch.Tensor | None = None  # [T, K] True where a pair was left out (degraded mode)
        self.twins: list[_Call] = []  # the same parts sent to second holders (--verify pair)

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
                    self.backend._send(self.layer, g, self.rows, c.parts, failed, deadline, self._dropped)
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
                end = _span(begins, call.parts)
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

    def _answer(self, c: _Call) -> list[tuple[_Call, torch.Tensor]]:
        """The rows of call c: from c itself or, when c stalls, from hedge calls to other holders."""
        b = self.backend
        after = b.hedge_after(c)
        if after is None or c.call.wait(after):
            return [b.observed(c)]
        hedges = b.hedge(self.layer, self.groups, self.rows, c)
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


class SwarmExperts:
    """Expert backend over remote nodes. `clients` maps address -> NodeClient; `placement` who holds what."""

    def __init__(
        self,
        clients: dict[str, NodeClient],
        placement: Placement,
        source: str,
        wire_dtype: torch.dtype = torch.float32,
        timeout: float = 30.0,
        call_bytes: int = CALL_BYTES,
        browser: NodeBrowser | None = None,
        key: SwarmKey | None = None,
        numerics: Numerics = Numerics.NATIVE,
        needed: Sequence[SlabKey] = (),
    ) -> None:
        self.clients = clients
        self.needed = list(needed)  # every (layer, expert) slab the model uses: what coverage is judged on
        self.placement = placement
        self.source = source
        self.wire_dtype = wire_dtype
        self.numerics = numerics  # sent with every call: nodes compute as the in-process backend would
        self.timeout = timeout
        self.call_bytes = call_bytes
        self.calls_per_node: Counter[str] = Counter()
        self.rows_per_node: Counter[str] = Counter()
        self.seconds_per_node: Counter[str] = Counter()  # waiting on answers
        self.failures_per_node: Counter[str] = Counter()
        self.failovers = 0
        self.hedges = 0  # calls sent again to another holder because the first was slow
        self.hedge_wins = 0  # ... and the other holder answered first
        self.wait_seconds = 0.0
        self.auditor: Auditor | None = None  # checks answers (probes, sampled audits); None: trusts them
        self.classes: dict[str, str] = {}  # address -> the node's numerics class (what its audits compare)
        self.same_class_only = False  # --numerics-class same: nodes of another class are passed over
        # Opt-in degraded mode (hivemind's k_min): an expert with no live holder is left out of the sum and
        # the weights of the experts that answered are renormalized, instead of waiting for a holder.
        self.degraded = False
        # --verify pair: every call also goes to a second holder (of the same numerics class where one
        # exists) and the two answers are compared; the auditor decides a disagreement
        self.pair = False
        self.paired_calls = 0  # calls whose answer a second holder's answer confirmed
        self.dropped_pairs = 0  # (token, slot) pairs left out that way
        self._admitted: set[str] = set()  # nodes probed (or not needing it) before their first pair
        self._pace: dict[str, float] = {}  # address -> seconds per row, a moving average of answered calls
        # mDNS keeps running after connect: nodes that join are used from the next layer on, nodes that
        # say goodbye are dropped before a call to them can fail.
        self.browser, self.key = browser, key
        self._browser_version = -1
        self._advertised: dict[str, set[SlabKey]] = {}  # address -> slabs its mDNS record announced
        self._admission: threading.Thread | None = None  # probing the nodes found at start (admit_known)

    def admit_known(self) -> None:
        """Probe the nodes found so far on a thread of their own, while the model loads (a probe checks a few
        of a node's slabs: cold slabs of the coordinator's own are first copied into ggml's repacked layout,
        milliseconds each), so that the first prompt does not wait for it. A node the thread has not admitted
        by the first call (a failed probe, a thread that died) is probed then, as a node found later is."""
        if self.auditor is None or self._admission is not None:
            return

        def run() -> None:
            for address in list(self.clients):
                try:
                    self._admit(address)
                except Exception as e:  # noqa: BLE001 - said, and probed again at its first call
                    log.warning(
                        "probing node %s at start failed (%s); it is probed at its first call", address, e
                    )

        self._admission = threading.Thread(target=run, name="swarm-admit", daemon=True)
        self._admission.start()

    def await_admission(self) -> None:
        """Wait for admit_known's thread: no call goes out while it probes. open_engine waits here once the
        model is loaded, so that what the admission has left (its probes, each of a cold slab read and copied
        into ggml's repacked layout first) is start-up, not the first prompt's time."""
        if self._admission is not None:
            self._admission.join()
            self._admission = None

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        self.await_admission()
        self.follow_mdns()
        self.placement.next_turn(layer)
        t, k = ids.shape
        groups = group_expert_major(ids)
        rows = groups.pack(x, k).to(device="cpu", dtype=self.wire_dtype)  # [N, D], what the wire carries
        parts = [Part(i, 0, n) for i, n in enumerate(groups.counts)]
        dropped: list[Part] = []
        calls = self._send(layer, groups, rows, parts, {}, dropped=dropped)
        pending = _SwarmPending(self, layer, groups, rows, calls, t, k, x.device)
        pending.drop(dropped)
        if self.pair and self.auditor is not None:
            pending.twins = [tw for c in calls for tw in self._twins(layer, groups, rows, c)]
        return _TimedPending(self, pending)

    def _send(
        self,
        layer: int,
        groups: ExpertMajor,
        rows: torch.Tensor,
        parts: Iterable[Part],
        failed: dict[int, list[str]],
        deadline: float | None = None,
        dropped: list[Part] | None = None,
    ) -> list[_Call]:
        """Compute calls for `parts` of the packed rows: one per chosen holder, or several when its rows
        exceed call_bytes. In degraded mode, parts no live node holds are added to `dropped` instead."""
        dropped = dropped if dropped is not None else []
        by_node: dict[str, list[Part]] = {}
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        for p in parts:
            try:
                address = self._holder_for(
                    layer, groups.expert_ids[p.index], failed.get(p.index, []), deadline
                )
            except _NoHolder:
                dropped.append(p)
                continue
            by_node.setdefault(address, []).append(p)
        return self._calls(layer, groups, rows, by_node)

    def _calls(
        self, layer: int, groups: ExpertMajor, rows: torch.Tensor, by_node: dict[str, list[Part]]
    ) -> list[_Call]:
        """One compute call (or several, when its rows exceed call_bytes) for each node's parts."""
        offsets = groups.offsets()
        max_rows = max(1, self.call_bytes // max(1, rows.shape[1] * rows.element_size()))
        calls = []
        for address, node_parts in by_node.items():
            for chunk in split_parts(node_parts, max_rows):
                begins = [offsets[p.index] + p.start for p in chunk]
                end = _span(begins, chunk)
                if end is not None:
                    part = rows[begins[0] : end]  # a view: the rows lie back to back already
                else:
                    part = torch.cat([rows[b : b + p.rows] for b, p in zip(begins, chunk, strict=True)])
                call = self.clients[address].compute_async(
                    layer,
                    [groups.expert_ids[p.index] for p in chunk],
                    [p.rows for p in chunk],
                    part,
                    self.timeout,
                    numerics=self.numerics,
                )
                self.calls_per_node[address] += 1
                self.rows_per_node[address] += int(part.shape[0])
                calls.append(_Call(address, chunk, call, int(part.shape[1]), part))
        return calls

    def _twins(self, layer: int, groups: ExpertMajor, rows: torch.Tensor, c: _Call) -> list[_Call]:
        """Call c's parts sent to a second holder each (--verify pair): one of c's node's numerics class where
        there is one (the answers are then compared bit for bit), else any other live holder; parts with no
        other holder go unpaired (the sampled audits still cover them)."""
        mine = self.classes.get(c.address, "")
        by_node: dict[str, list[Part]] = {}
        for p in c.parts:
            expert = groups.expert_ids[p.index]
            others = [a for a in self.placement.live(layer, expert, [c.address]) if a in self._admitted]
            if not others:
                continue
            alike = [a for a in others if same_class(self.classes.get(a, ""), mine)]
            choice = (alike or others)[(layer * 31 + expert) % len(alike or others)]
            by_node.setdefault(choice, []).append(p)
        return self._calls(layer, groups, rows, by_node)

    def follow_mdns(self) -> None:
        """Take in the nodes mDNS has found or lost since the last look (cheap when nothing changed)."""
        b = self.browser
        if b is None or b.version == self._browser_version:
            return
        self._browser_version = b.version
        now = {
            n.address: n
            for n in b.nodes()
            if not self.same_class_only or same_class(n.numerics_class, numerics_class())
        }
        for address, n in now.items():
            self.classes[address] = n.numerics_class
            if address not in self.clients:
                self.clients[address] = NodeClient(
                    address,
                    fingerprint=n.identity.fingerprint,
                    key=self.key,
                    tls=n.tls,
                    stream_port=n.stream_port,
                )
                log.info("node joined: %s (%d slabs)", address, len(n.held))
            held = set(n.held)
            known = self._advertised.get(address)
            if known is None:
                self.placement.add(address, held)
            else:
                if held - known:  # a fetching node announces the slabs it has verified since
                    self.placement.add(address, held - known, revive=False)
                    log.info("node %s holds %d more slabs", address, len(held - known))
                if known - held:  # ... and a node drops those whose files failed its own check
                    self.placement.drop(address, known - held)
                    log.warning("node %s no longer serves %d slabs", address, len(known - held))
            self._advertised[address] = held
        for address in self._advertised.keys() - now.keys():
            self.placement.remove(address)
            log.info("node left: %s; its experts go to the other holders", address)
        self._advertised = {a: h for a, h in self._advertised.items() if a in now}

    def hedge_after(self, c: _Call) -> float | None:
        """How long to wait for call c before asking another holder; None: no estimate for its node yet."""
        pace = self._pace.get(c.address)
        if pace is None:
            return None
        return max(HEDGE_AFTER_MIN, HEDGE_FACTOR * pace * sum(p.rows for p in c.parts))

    def hedge(self, layer: int, groups: ExpertMajor, rows: torch.Tensor, c: _Call) -> list[_Call]:
        """Call c's parts sent to other live holders; none when some expert of c has no other holder."""
        experts = {groups.expert_ids[p.index] for p in c.parts}
        if any(self.placement.pick(layer, e, avoid=[c.address]) is None for e in experts):
            return []
        calls = self._send(layer, groups, rows, c.parts, {p.index: [c.address] for p in c.parts})
        self.hedges += len(calls)
        return calls

    def observed(self, c: _Call) -> tuple[_Call, torch.Tensor]:
        """(c, its rows), waiting for them, and the node's pace updated with how long they took.

        An answer of the wrong shape (a buggy or mismatched node) fails like a broken call: INTERNAL, which
        sends the rows to another holder instead of mixing garbage into the sum.
        """
        result = c.call.result()
        expect = (sum(p.rows for p in c.parts), c.width)
        if tuple(result.shape) != expect:
            raise NodeCallError(
                c.address,
                "Compute",
                grpc.StatusCode.INTERNAL,
                f"answered rows of shape {list(result.shape)} for a call of shape {list(expect)}",
            )
        self.placement.mark_up(c.address)
        if c.call.seconds is not None:
            self.seconds_per_node[c.address] += c.call.seconds
            pace = c.call.seconds / max(1, sum(p.rows for p in c.parts))
            old = self._pace.get(c.address)
            self._pace[c.address] = pace if old is None else 0.8 * old + 0.2 * pace
        return c, result

    def node_failed(self, address: str) -> None:
        """A call to this node failed (gone, deadline, refused): back off from it; probe it again when it is
        back (a restarted node may be another process)."""
        self.placement.mark_down(address)
        self._admitted.discard(address)
        self.failovers += 1
        self.failures_per_node[address] += 1

    def _holder_for(self, layer: int, expert: int, failed: list[str], deadline: float | None = None) -> str:
        """An admitted live holder that has not failed this expert in this step; else one back from its
        backoff; while every holder is down, wait for one until `deadline` (the call's --timeout)."""
        while True:
            address = self._pick(layer, expert, failed, deadline)
            if self._admit(address):
                return address

    def _admit(self, address: str) -> bool:
        """Probe a node before its first pair (the auditor's known rows through some of its slabs)."""
        if address in self._admitted or self.auditor is None:
            return True
        c = self.clients[address]
        held = sorted(k for k, hs in self.placement.holders().items() if address in hs)

        def compute(layer: int, ids: list[int], counts: list[int], rows: torch.Tensor) -> torch.Tensor:
            return c.compute(layer, ids, counts, rows, self.timeout, numerics=self.numerics)

        try:
            width = self.auditor.store.hidden_size or 0
            ok = self.auditor.probe(address, held, compute, width)
        except NodeCallError as e:
            log.warning("node %s failed its admission probe (%s); passing it over for now", address, e)
            self.placement.mark_down(address)
            return False
        if not ok:
            self.placement.ban(address)
            return False
        self._admitted.add(address)
        return True

    def _pick(self, layer: int, expert: int, failed: list[str], deadline: float | None) -> str:
        while True:
            address = self.placement.pick(layer, expert, avoid=failed)
            if address is None and failed:
                address = self.placement.pick(layer, expert)  # one that failed before, back from its backoff
            if address is not None:
                return address
            if self.degraded:
                raise _NoHolder()
            if not failed and not any(
                a
                for a in self.placement.holders().get((layer, expert), ())
                if not self.placement.is_banned(a)
            ):
                raise UserError(describe_missing({layer: [expert]}, self.source))
            if deadline is None or time.monotonic() >= deadline:
                failed = failed or [a for a in self.placement.holders().get((layer, expert), [])]
                raise UserError(
                    f"layer {layer} expert {expert}: every holder failed ({', '.join(dict.fromkeys(failed))}) "
                    f"for {self.timeout:g} s; check those nodes (`swarm node` logs), add replicas, or raise "
                    "--timeout"
                )
            time.sleep(RETRY_SECONDS)
            self.follow_mdns()

    def close(self) -> None:
        self.await_admission()
        if self.auditor is not None:
            self.auditor.close()
        if self.browser is not None:
            self.browser.close()
            self.browser = None
        for c in self.clients.values():
            c.close()


class _NoHolder(Exception):
    """Degraded mode: no live node holds this expert now."""


class _TimedPending:
    """Counts the time the model spends blocked on the swarm (what overlapping did not hide)."""

    in_flight = True  # the nodes compute until wait(): what the model does meanwhile overlaps them

    def __init__(self, backend: SwarmExperts, inner: _SwarmPending) -> None:
        self.backend, self.inner = backend, inner

    @property
    def dropped(self) -> torch.Tensor | None:
        return self.inner.dropped

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self.inner.wait()
        finally:
            self.backend.wait_seconds += time.perf_counter() - t0


def connect(
    needed: Sequence[SlabKey],
    identity: ModelIdentity | str,
    source: str,
    peers: Sequence[str] = (),
    mdns: bool = True,
    interfaces: Sequence[str] | None = None,
    wait: float = 3.0,
    key: SwarmKey | None = None,
    wire_dtype: torch.dtype = torch.float32,
    timeout: float = 30.0,
    numerics: Numerics = Numerics.NATIVE,
    same_class_only: bool = False,
) -> SwarmExperts:
    """Find nodes (static peers, then mDNS until every needed slab has a holder or `wait` s pass).

    A node is taken when `identity` matches its own (the same model, started on the GGUF or on its shard
    directory: see swarm.sharding.identity; a bare fingerprint string matches exactly that fingerprint). Each
    node's calls then carry the fingerprint that node itself reports, which it checks on every call.
    `same_class_only` (--numerics-class same): nodes of another numerics class than this process's ggml
    build (swarm.compute.numclass) are passed over, so that every answer is checked bit for bit.
    """
    if isinstance(identity, str):
        identity = ModelIdentity(identity)
    placement = Placement()
    clients: dict[str, NodeClient] = {}
    by_header: list[str] = []  # nodes taken on the source GGUF's header hash alone
    strangers: list[str] = []  # peers of another model, passed over
    classes: dict[str, str] = {}  # address -> numerics class, of every node taken
    own_class = numerics_class()
    other_class: set[str] = set()  # passed over for --numerics-class same

    def class_ok(address: str, cls: str) -> bool:
        if not same_class_only or same_class(cls, own_class):
            return True
        if address not in other_class:
            other_class.add(address)
            log.warning(
                "passing over node %s: its numerics class is %s, this coordinator's %s "
                "(--numerics-class same takes only bit-exact nodes)", address, cls or "not said", own_class,
            )  # fmt: skip
        return False

    def add(
        address: str, node: ModelIdentity, held: Iterable[SlabKey], tls: bool, stream_port: int, cls: str
    ) -> None:
        if not class_ok(address, cls):
            return
        classes[address] = cls
        if address not in clients:
            clients[address] = NodeClient(
                address, fingerprint=node.fingerprint, key=key, tls=tls, stream_port=stream_port
            )
            if identity.match(node) is Match.HEADER:
                by_header.append(address)
        placement.add(address, held)

    for peer in peers:
        try:
            client, info = ask_peer(peer, key, timeout=min(wait, 10.0) if wait > 0 else 10.0)
        except NodeCallError as e:
            raise UserError(
                f"peer {peer} does not answer ({e.code.name}); is `swarm node` running there?"
            ) from None
        match = identity.match(info.identity)
        if match is None:
            client.close()
            log.warning(
                "passing over peer %s: it serves another model (fingerprint %s, this swarm's is %s); "
                "start it on the same GGUF or shard directory",
                peer,
                info.fingerprint[:12],
                identity.fingerprint[:12],
            )
            strangers.append(peer)
            continue
        if not class_ok(peer, info.numerics_class):
            client.close()
            continue
        classes[peer] = info.numerics_class
        client.fingerprint = info.fingerprint  # what the node checks in every Compute call
        clients[peer] = client
        if match is Match.HEADER:
            by_header.append(peer)
        placement.add(peer, info.held)

    browser = None
    if mdns and placement.missing(needed):
        from swarm.node.discovery import browse

        browser = browse(interfaces=interfaces, identity=identity, key=key)

        def covered(nodes: list) -> bool:
            for n in nodes:
                add(n.address, n.identity, n.held, n.tls, n.stream_port, n.numerics_class)
            return not placement.missing(needed)

        if browser.wait_for(covered, wait) is not None:
            # Other nodes answer the same query within a few hundred ms (mDNS responders wait 20-120
            # ms at random): take them too, they are the replicas a failover will need.
            time.sleep(min(MDNS_SETTLE_SECONDS, wait))
        for n in browser.nodes():
            add(n.address, n.identity, n.held, n.tls, n.stream_port, n.numerics_class)

    missing = placement.missing(needed)
    if missing:
        if browser is not None:
            browser.close()
        for c in clients.values():
            c.close()
        if not clients:
            hint = "" if mdns else " (mDNS is off: give --peer host:port)"
            if strangers:
                hint += f" (passed over {', '.join(strangers)}: another model)"
            if other_class:
                hint += f" (passed over {', '.join(sorted(other_class))}: another numerics class, --numerics-class same)"
            raise UserError(
                f"no swarm nodes found for this model{hint}. Start one with `swarm node {source} --experts 0-7` "
                "on this or another machine, or run with --local to compute the experts here"
            )
        raise UserError(describe_missing(missing, source))
    if by_header:
        log.info(
            "swarm: %d of %d nodes recognised by the source GGUF's header hash only, not the fingerprint over "
            "every weight (a file with the same header but other weights would pass too): %s",
            len(by_header),
            len(clients),
            ", ".join(sorted(by_header)),
        )
    log.info("swarm: %d nodes cover %d slabs", len(clients), len(needed))
    experts = SwarmExperts(
        clients,
        placement,
        source,
        wire_dtype,
        timeout,
        browser=browser,
        key=key,
        numerics=numerics,
        needed=needed,
    )
    experts.classes.update(classes)
    experts.same_class_only = same_class_only
    if browser is not None:
        experts.follow_mdns()  # what connect saw is the starting point for joins and leaves
    return experts
