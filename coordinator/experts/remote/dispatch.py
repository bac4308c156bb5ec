"""The swarm expert backend: each layer's calls sent to the holders of its experts, the nodes admitted
(probed) before their first call, a failed node's experts sent to another holder, a stalled one hedged, and
the nodes mDNS finds or loses (and those that join or lose their link) followed between layers. Built complete by `discovery.connect`."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import grpc
import torch

from swarm.compute.numclass import numerics_class, same_class
from swarm.coordinator.checks.audit import Auditor
from swarm.coordinator.checks.twins import TwinAnswer, compare_twins
from swarm.coordinator.config import EngineConfig, Verify, Wire
from swarm.coordinator.experts.backend import ExpertMajor, PendingExperts, group_expert_major
from swarm.coordinator.experts.remote.calls import Part, SentCall, WireRows, split_parts
from swarm.coordinator.experts.remote.pending import SwarmPending, TimedPending
from swarm.coordinator.experts.remote.placement import Placement, describe_missing
from swarm.coordinator.experts.remote.wire import Q8Wire
from swarm.node.auth import SwarmKey
from swarm.node.client import NodeCallError, NodeClient
from swarm.proto.channel import PROTOCOL_VERSION
from swarm.proto.numerics import Numerics
from swarm.proto.planes import PLANES
from swarm.sharding.errors import UserError
from swarm.sharding.slabs import SlabKey

if TYPE_CHECKING:
    from swarm.coordinator.experts.remote.joins import Sources
    from swarm.node.discovery import NodeBrowser

log = logging.getLogger(__name__)

# While every holder of an expert is down, how often to look again (until the call's --timeout).
RETRY_SECONDS = 0.05
# Hedging: a call still unanswered after HEDGE_FACTOR times what this node usually takes for that many rows
# (and at least HEDGE_AFTER_MIN s) is sent again to another holder of its experts, and the first complete
# answer is used: both compute the same rows in the same matmul blocks, so either gives the same bits. A node
# that loses the race this way is passed over like a failed one (a phone gone to sleep stalls rather than
# fails: its calls would otherwise wait for the whole --timeout).
HEDGE_FACTOR = 4.0
HEDGE_AFTER_MIN = 0.5


class SwarmExperts:
    """Expert backend over remote nodes. `clients` maps address -> NodeClient; `placement` who holds what;
    `classes` address -> a node's numerics class (the auditor's own map: nodes that join later too);
    `auditor` checks the answers (probes, sampled audits; None: trusts them), and bans through the
    placement; `browser` the mDNS browser kept running: nodes that join are used from the next layer on,
    nodes that say goodbye are dropped before a call to them can fail."""

    def __init__(
        self,
        clients: dict[str, NodeClient],
        placement: Placement,
        source: str,
        config: EngineConfig,
        needed: Sequence[SlabKey] = (),
        browser: NodeBrowser | Sources | None = None,
        classes: dict[str, str] | None = None,
        auditor: Auditor | None = None,
    ) -> None:
        self.clients, self.placement, self.source, self.config = clients, placement, source, config
        self.needed = list(needed)  # every (layer, expert) slab the model uses: what coverage is judged on
        self.classes: dict[str, str] = {} if classes is None else classes
        self.auditor = auditor
        # --wire q8 in native numerics: rows go as the 8-bit blocks their kernels quantize them to, where the
        # layer's experts have such a type, and the answers come back packed in byte planes (proto.planes)
        q8 = config.wire is Wire.Q8 and config.numerics == Numerics.NATIVE
        self._q8: Q8Wire | None = Q8Wire(source) if q8 else None
        self.calls_per_node: Counter[str] = Counter()
        self.rows_per_node: Counter[str] = Counter()
        self.row_bytes_per_node: Counter[str] = Counter()  # the rows' bytes in the calls (less framing)
        self.answer_bytes_per_node: Counter[str] = Counter()  # the answers' bytes in the replies
        self.inner_bytes_per_node: Counter[str] = Counter()  # ... and their inner products' (--verify project)
        # the answers carry their gate and up products where the auditor checks them by projections
        self._inner = auditor is not None and auditor.projections is not None
        self.seconds_per_node: Counter[str] = Counter()  # waiting on answers
        self.failures_per_node: Counter[str] = Counter()
        self.failovers = 0
        self.hedges = 0  # calls sent again to another holder because the first was slow
        self.hedge_wins = 0  # ... and the other holder answered first
        self.wait_seconds = 0.0
        self.twin_calls = 0  # calls whose answer a second holder's answer confirmed (--verify pair)
        self.dropped_pairs = 0  # (token, slot) pairs left out in degraded mode
        self._admitted: set[str] = set()  # nodes probed (or not needing it) before their first call
        self._pace: dict[str, float] = {}  # address -> seconds per row, a moving average of answered calls
        self.browser = browser
        self._browser_version = -1
        self._advertised: dict[str, set[SlabKey]] = {}  # address -> slabs its mDNS record announced
        self._admission: threading.Thread | None = None  # probing the nodes found at start (admit_known)
        if browser is not None:
            self.follow_mdns()  # what discovery saw is the starting point for joins and leaves

    @property
    def timeout(self) -> float:
        return self.config.timeout

    @property
    def key(self) -> SwarmKey | None:
        """The swarm key calls are signed with (also for the nodes mDNS finds later)."""
        return self.config.key

    @property
    def degraded(self) -> bool:
        """An expert with no live holder is left out of the sum, the weights of the rest renormalized."""
        return self.config.degraded

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

    def stack(self, layer: int, ids: torch.Tensor) -> None:
        return None  # the nodes compute the experts: the MoE block's one-graph path is not for them

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> PendingExperts:
        self.await_admission()
        self.follow_mdns()
        self.placement.next_turn(layer)
        t, k = ids.shape
        major = group_expert_major(ids)
        rows = self._wire_rows(layer, major, x, k)  # [N, D], what the wire carries
        parts = [Part(i, 0, n) for i, n in enumerate(major.counts)]
        dropped: list[Part] = []
        calls = self.send(layer, major, rows, parts, {}, dropped=dropped)
        twins = []
        if self.config.verify is Verify.TWINS and self.auditor is not None:
            twins = [tw for c in calls for tw in self._twins(layer, major, rows, c)]
        pending = SwarmPending(self, layer, major, rows, calls, t, k, x.device, dropped, twins)
        return TimedPending(self, pending)

    def _wire_rows(self, layer: int, major: ExpertMajor, x: torch.Tensor, k: int) -> WireRows:
        values = major.pack(x, k).to(device="cpu", dtype=self.config.wire.dtype)
        made = self._q8.blocks(layer, x) if self._q8 is not None else None  # each token's row once, then packed
        if made is None:
            return WireRows(values)
        qtype, blocks = made
        return WireRows(values, major.pack(blocks, k), qtype)

    def send(
        self,
        layer: int,
        major: ExpertMajor,
        rows: WireRows,
        parts: Iterable[Part],
        failed: dict[int, list[str]],
        deadline: float | None = None,
        dropped: list[Part] | None = None,
    ) -> list[SentCall]:
        """Compute calls for `parts` of the packed rows: one per chosen holder, or several when its rows
        exceed the config's call_bytes. In degraded mode, parts no live node holds are added to `dropped` instead."""
        dropped = dropped if dropped is not None else []
        by_node: dict[str, list[Part]] = {}
        if deadline is None:
            deadline = time.monotonic() + self.config.timeout
        for p in parts:
            try:
                address = self._holder_for(
                    layer, major.expert_ids[p.index], failed.get(p.index, []), deadline
                )
            except _NoHolder:
                dropped.append(p)
                continue
            by_node.setdefault(address, []).append(p)
        return self._calls(layer, major, rows, by_node)

    def _calls(
        self, layer: int, major: ExpertMajor, rows: WireRows, by_node: dict[str, list[Part]]
    ) -> list[SentCall]:
        """One compute call (or several, when its rows exceed call_bytes) for each node's parts."""
        offsets = major.offsets()
        max_rows = max(1, self.config.call_bytes // max(1, rows.row_bytes))
        packed = self.config.wire is Wire.Q8  # the answers in byte planes (also where the rows are float32)
        calls = []
        for address, node_parts in by_node.items():
            for chunk in split_parts(node_parts, max_rows):
                begins = [offsets[p.index] + p.start for p in chunk]
                part, carried = rows.take(begins, chunk)
                call = self.clients[address].compute_async(
                    layer,
                    [major.expert_ids[p.index] for p in chunk],
                    [p.rows for p in chunk],
                    carried,
                    self.config.timeout,
                    PLANES if packed else None,
                    numerics=self.config.numerics,
                    inner=self._inner,
                )
                self.calls_per_node[address] += 1
                self.rows_per_node[address] += int(part.shape[0])
                self.row_bytes_per_node[address] += int(part.shape[0]) * rows.row_bytes
                calls.append(SentCall(address, chunk, call, int(part.shape[1]), part))
        return calls

    def _twins(self, layer: int, major: ExpertMajor, rows: WireRows, c: SentCall) -> list[SentCall]:
        """Call c's parts sent to a second holder each (--verify pair): one of c's node's numerics class where
        there is one (the answers are then compared bit for bit), else any other live holder; parts with no
        other holder go unpaired (the sampled audits still cover them)."""
        mine = self.classes.get(c.address, "")
        by_node: dict[str, list[Part]] = {}
        for p in c.parts:
            expert = major.expert_ids[p.index]
            others = [a for a in self.placement.live(layer, expert, [c.address]) if a in self._admitted]
            if not others:
                continue
            alike = [a for a in others if same_class(self.classes.get(a, ""), mine)]
            choice = (alike or others)[(layer * 31 + expert) % len(alike or others)]
            by_node.setdefault(choice, []).append(p)
        return self._calls(layer, major, rows, by_node)

    def follow_mdns(self) -> None:
        """Take in the nodes mDNS has found or lost since the last look (cheap when nothing changed)."""
        b = self.browser
        if b is None or b.version == self._browser_version:
            return
        self._browser_version = b.version
        now = {
            n.address: n
            for n in b.nodes()
            if (not self.config.same_class_only or same_class(n.numerics_class, numerics_class()))
            and n.protocol_version == PROTOCOL_VERSION  # (a node refuses every call of another version)
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
                    dial=n.dial,
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

    def hedge_after(self, c: SentCall) -> float | None:
        """How long to wait for call c before asking another holder; None: no estimate for its node yet."""
        pace = self._pace.get(c.address)
        if pace is None:
            return None
        return max(HEDGE_AFTER_MIN, HEDGE_FACTOR * pace * sum(p.rows for p in c.parts))

    def hedge(self, layer: int, major: ExpertMajor, rows: WireRows, c: SentCall) -> list[SentCall]:
        """Call c's parts sent to other live holders; none when some expert of c has no other holder."""
        experts = {major.expert_ids[p.index] for p in c.parts}
        if any(self.placement.pick(layer, e, avoid=[c.address]) is None for e in experts):
            return []
        calls = self.send(layer, major, rows, c.parts, {p.index: [c.address] for p in c.parts})
        self.hedges += len(calls)
        return calls

    def hedge_won(self, address: str) -> None:
        self.hedge_wins += 1
        self.placement.mark_down(address)

    def checked(self, c: SentCall, layer: int, major: ExpertMajor, answer: torch.Tensor) -> torch.Tensor:
        """c's answer booked with the auditor (which may audit it now or aside, and bans a node it catches
        through the placement); the coordinator's own rows where an inline audit caught the node."""
        if self.auditor is None:
            return answer
        ids = [major.expert_ids[p.index] for p in c.parts]
        return self.auditor.answered(
            c.address, layer, ids, [p.rows for p in c.parts], c.sent, answer,
            c.call.inner_products if c.call.has_inner else None,
        )

    def spare(self, waiting: Callable[[], bool]) -> None:
        if self.auditor is not None:
            self.auditor.spare(waiting)

    def compare_twins(self, layer: int, answers: list[TwinAnswer]) -> None:
        assert self.auditor is not None  # (twins are sent only with one)
        compare_twins(self.auditor, layer, answers)
        self.twin_calls += 1

    def left_out(self, pairs: int) -> None:
        self.dropped_pairs += pairs

    def waited(self, seconds: float) -> None:
        self.wait_seconds += seconds

    def observed(self, c: SentCall) -> tuple[SentCall, torch.Tensor]:
        """(c, its rows), waiting for them, and the node's pace updated with how long they took.

        An answer of the wrong shape (a buggy or mismatched node) fails like a broken call: INTERNAL, which
        sends the rows to another holder instead of mixing garbage into the sum.
        """
        result = c.call.result()
        self.answer_bytes_per_node[c.address] += c.call.answer_bytes
        self.inner_bytes_per_node[c.address] += c.call.inner_bytes
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
        """Probe a node before its first call (the auditor's known rows through some of its slabs); a node
        that fails it is banned by the auditor, through the placement."""
        if address in self._admitted or self.auditor is None:
            return True
        c = self.clients[address]
        held = sorted(k for k, hs in self.placement.holders().items() if address in hs)

        def compute(layer: int, ids: list[int], counts: list[int], rows: torch.Tensor) -> torch.Tensor:
            return c.compute(layer, ids, counts, rows, self.config.timeout, numerics=self.config.numerics)

        try:
            width = self.auditor.store.hidden_size or 0
            ok = self.auditor.probe(address, held, compute, width)
        except NodeCallError as e:
            log.warning("node %s failed its admission probe (%s); passing it over for now", address, e)
            self.placement.mark_down(address)
            return False
        if ok:
            self._admitted.add(address)
        return ok

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
                    f"for {self.config.timeout:g} s; check those nodes (`swarm node` logs), add replicas, or raise "
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
