"""Checking the nodes' answers: probes on admission, sampled audits while they serve, bans, and what is settled.

A check compares a node's answer with the coordinator's own on its own slabs (swarm.coordinator.checks.recompute:
the same bits, or within the kernels' error bound from a node of another numerics class).

- Probe: before a node gets its first pair, rows of known values go through a few of the slabs it claims.
- Audit: each answered call is checked here with probability `rate` (chosen after the answer arrived, so
  a node cannot tell which answers are checked): with native numerics, one row of each of up to
  AUDIT_EXPERTS of its experts, drawn at random, is recomputed. A node whose answer differs is banned for
  the run: it never gets another pair (`on_ban` tells the placement at once). Audits run on a thread of
  their own, one core, beside the model's next layers (a check of a cold expert copies its slab into
  ggml's repacked layout: milliseconds the model need not wait for), at the idle scheduling priority
  (swarm.compute.priority): they take the cores the model and the nodes leave free, rather than time slices from
  them. A settle takes in the verdicts that are in; a forced one waits for all, and does here every
  audit the thread has not started (and one it has started but not finished within TAKE_OVER seconds,
  again: a busy machine may give an idle-priority thread almost nothing).
  Without that thread (`background=False`) an audit runs in the call, and a caught answer is replaced by the
  coordinator's.
- Settling: an answer counts as checked once a later audit of the same node passed. `settle()` says whether
  everything since the last settle is checked (SETTLED), still open (OPEN), or whether a node was caught
  (CAUGHT: the work since the last settled point must be done again, without that node). With `force`, it
  audits the latest call of every node that is still open (on this thread and the audit thread at once),
  so that open work never piles up. The model waits for those forced audits, so each checks one row of
  each of the call's ready experts (repacked copy made: up to AUDIT_EXPERTS), or of one when none is.
- Projections (--verify project, the default): an answer that carries its inner products is checked by them
  (swarm.coordinator.checks.projection) in the time the model next waits for a node (`spare`: once a layer,
  at its first wait, every answer not yet checked, the earlier layers', in one batch; a batch costs a few
  dozen array operations where each call alone took about as many), and what is left at the settle (the
  last layer's): not on the model's way where it has a wait to fill. One that fails is recomputed here,
  whole, before any verdict; the pass a wrong answer shaped is done again without its node (CAUGHT), as
  after a failed audit.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarm.compute.ggml import one_thread
from swarm.compute.priority import idle_priority
from swarm.compute.store import ExpertStore
from swarm.coordinator.checks.books import AuditReport, Call, Job, NodeBook, Scope, Verdict
from swarm.coordinator.checks.projection import Answered, Projections, unit_roundoff
from swarm.coordinator.checks.recompute import Recomputer, own_store
from swarm.coordinator.config import DEFAULT_AUDIT_RATE, EngineConfig, Verify
from swarm.proto.codec import CodecError
from swarm.proto.numerics import Numerics
from swarm.sharding.slabs import SlabKey

log = logging.getLogger(__name__)

PROBE_SLABS = 4  # slabs of a new node sent known rows before it is used
PROBE_ROWS = 2
# Experts of one call an audit checks (one row each), drawn at random: a prompt's call holds a node's share of
# a layer's experts, and checking each (a cold one first copied into ggml's repacked layout) is slow.
AUDIT_EXPERTS = 8
# Seconds a forced settle waits for an audit the audit thread is running before it does the audit itself.
TAKE_OVER = 0.05


class Auditor(Recomputer):
    """Recomputes sampled calls on the coordinator's own slabs and keeps the books of what is checked."""

    def __init__(
        self,
        store: ExpertStore,
        numerics: Numerics,
        row_dtype: torch.dtype,
        rate: float = DEFAULT_AUDIT_RATE,
        shard_dir: Path | None = None,
        seed: int | None = None,
        background: bool = True,
        every_row: bool = False,
        classes: dict[str, str] | None = None,
        on_ban: Callable[[str], None] | None = None,
        projections: Projections | None = None,
    ) -> None:
        """`projections`: every answer that carries its inner products checked by them (--verify project),
        one that fails recomputed exactly before anything is decided; `row_dtype`: the float type of the rows
        nodes are sent (probe rows are made in it); `every_row`:
        every answer recomputed here, whole (--verify all); `classes`: address -> a node's numerics class;
        `on_ban`: told the address of every node banned (the placement, which then never picks it)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"audit rate {rate} is not between 0 and 1")
        super().__init__(store, numerics, shard_dir, classes)
        self.row_dtype, self.rate, self.every_row = row_dtype, rate, every_row
        self.projections = projections
        self._on_ban = on_ban
        self._rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._books: dict[str, NodeBook] = {}
        self._caught = False
        self._lock = threading.Lock()
        self.report = AuditReport()
        self._worker = (
            ThreadPoolExecutor(1, thread_name_prefix="swarm-audit", initializer=idle_priority)
            if background
            else None
        )
        self._pending: list[Job] = []  # audits handed to the audit thread, not yet taken in
        self._projected: list[tuple[str, Call, Any]] = []  # answers for the projections, not yet checked
        self._cover = False  # the pass under way reads a prompt: each of its calls is checked (cover())

    # --- probes and audits ------------------------------------------------------------------------------

    def probe(
        self, address: str, held: list[SlabKey], compute: Any, width: int, slabs: int = PROBE_SLABS
    ) -> bool:
        """Known rows through `slabs` of the node's slabs at random (`compute(layer, ids, counts, rows)` calls
        it); False (and the node banned) when an answer differs."""
        mine = [k for k in held if self.store.holds(*k)]  # (a slab file is read once drawn, not to list)
        for layer, expert in self._rng.sample(mine, min(slabs, len(mine))):
            if not self.holds(layer, [expert]):
                continue
            g = torch.Generator().manual_seed(self._rng.randrange(2**31))
            rows = torch.randn(PROBE_ROWS, width, generator=g).to(self.row_dtype)
            answer = compute(layer, [expert], [PROBE_ROWS], rows)
            self.report.probes += 1
            own = self.expected(layer, [expert], [PROBE_ROWS], rows)
            same = self._agrees(address, layer, [expert] * PROBE_ROWS, rows, own, answer)
            if not same and self._ours_verify(layer, [expert]):
                self._ban(
                    address, f"its answer for layer {layer} expert {expert} differs from the model's slab"
                )
                return False
        return True

    def answered(
        self, address: str, layer: int, expert_ids: list[int], counts: list[int], rows: torch.Tensor,
        answer: torch.Tensor, inner: Any = None,
    ) -> torch.Tensor:  # fmt: skip
        """Book one answered call; check it by its projections where it carries its `inner` products, audit
        it with probability `rate` (at least sample's where they cannot). The rows to use: the answer, or the
        coordinator's own when a check caught the node."""
        call = Call(layer, list(expert_ids), list(counts), rows, answer)
        with self._lock:
            book = self._books.setdefault(address, NodeBook())
            book.last_call = call
            book.open_calls += 1
            book.calls += 1
        projected = self._projectable(call, inner)
        if projected:
            with self._lock:  # checked in the model's next wait for a node (spare), or at the settle
                self._projected.append((address, call, inner))
        scope = Scope.EVERY_ROW if self.every_row else Scope.EVERY_EXPERT if self._cover and not projected else None
        rate = self.rate if projected or self.projections is None else max(self.rate, DEFAULT_AUDIT_RATE)
        if scope is None and rate > 0 and self._rng.random() < rate:
            scope = Scope.SAMPLE
        if scope is not None:
            if self._worker is not None:
                job = self._aside(address, call, scope)
                with self._lock:
                    self._pending.append(job)
                return answer
            own = self._audit(address, call, scope)
            if own is not None:
                return own
        return answer

    def spare(self, waiting: Callable[[], bool]) -> None:
        """Time the model would spend waiting for a node's answer (`waiting()`: whether it still would): the
        answers booked since the last check are checked by their projections now, in one batch, rather than
        at the settle, where the model would wait for them. A wrong one bans its node at once (on_ban), so
        the rest of the pass goes to others, and the settle says CAUGHT."""
        if self._projected and waiting():
            with self._lock:
                self.report.spared += len(self._projected)
            self._project_all()

    def _projectable(self, call: Call, inner: Any) -> bool:
        p = self.projections
        return p is not None and inner is not None and p.checkable(call.layer, call.expert_ids)

    def _project_all(self) -> None:
        """The projections' check of every answer booked since the last settle, in one batch (a pass's calls
        of every layer: Projections.check_many). An answer that fails is recomputed exactly before anything
        is decided; a wrong one bans its node (the settle then says CAUGHT: the work is done again)."""
        with self._lock:
            todo, self._projected = self._projected, []
        if todo:
            self._verdicts(todo)

    def _verdicts(self, todo: list[tuple[str, Call, Any]]) -> None:
        """Check these answers by the projections in one batch; one that fails is recomputed exactly, and a
        node whose answer that finds wrong is banned."""
        p = self.projections
        assert p is not None
        native = self.numerics == Numerics.NATIVE
        failed = p.check_many([
            Answered(call.layer, call.expert_ids, call.counts, call.rows.float().numpy(),
                     call.answer.float().numpy(), _inner(address, inner), native, unit_roundoff(call.answer.dtype),
                     self.other_class(address))
            for address, call, inner in todo
        ])  # fmt: skip
        for (address, call, _), f in zip(todo, failed, strict=True):
            if self.is_banned(address):
                continue  # (caught at an earlier answer of the batch: its work is done again, unchecked)
            if f is None:
                self._checked(address, call, counted=False, projected=True)
                continue
            log.warning("node %s: %s check failed, layer %d, %d rows (%.3g x tolerance): recomputing exactly",
                        address, f.what, call.layer, len(f.rows), f.worst)  # fmt: skip
            self._audit(address, call, Scope.EVERY_ROW)
            with self._lock:
                self.report.projected, self.report.alarms = self.report.projected + 1, self.report.alarms + 1
                self.report.false_alarms += not self.is_banned(address)

    def decide(
        self, address: str, layer: int, experts: list[int], rows: torch.Tensor, answer: torch.Tensor
    ) -> bool:
        """Two holders answered these rows (row i through experts[i]) differently (--verify pair): recompute
        them here now; the node is banned when its answer is not an honest one (see _agrees). Whether it
        holds (True too when this coordinator cannot make the rows: the sampled audits stay)."""
        unique = sorted(set(experts))
        if not self.holds(layer, unique):
            log.warning(
                "nodes disagree on layer %d experts %s, which this coordinator cannot check", layer, unique
            )
            return True
        order = torch.tensor(sorted(range(len(experts)), key=lambda i: experts[i]))  # expert-major
        rows, theirs = rows.index_select(0, order), answer.index_select(0, order)
        per_row = [experts[int(i)] for i in order]
        own = self.expected(layer, unique, [per_row.count(e) for e in unique], rows)
        with self._lock:
            self.report.audits += 1
        if self._agrees(address, layer, per_row, rows, own, theirs):
            with self._lock:
                self.report.passed[address] += 1
            return True
        if not self._ours_verify(layer, unique):
            return True
        self._ban(
            address,
            f"its answer for layer {layer} experts {unique} differs from the model's slabs "
            "(found where a second holder's answer disagreed)",
        )
        return False

    def cover(self, on: bool) -> None:
        """Whether every call answered from now on is checked before its pass settles, one row of each of its
        experts (`on`: the pass reads a prompt), rather than sampled at `rate` (decode steps)."""
        self._cover = on

    def _aside(self, address: str, call: Call, scope: Scope = Scope.SAMPLE) -> Job:
        assert self._worker is not None
        return Job(self._worker.submit(self._audit_here, address, call, scope), address, call, scope)

    def _audit_here(self, address: str, call: Call, scope: Scope = Scope.SAMPLE) -> None:
        with one_thread():
            self._audit(address, call, scope)

    def _finish(self, job: Job) -> None:
        """The verdict of an audit handed to the audit thread, now: done here when the thread has not
        started it, or has not finished it within TAKE_OVER seconds (an audit that failed raises here)."""
        if job.future.cancel():
            self._audit_here(job.address, job.call, job.scope)
            return
        try:
            job.future.result(timeout=TAKE_OVER)
        except FutureTimeout:
            self._audit_here(job.address, job.call, job.scope)  # (the thread's own verdict comes too)

    def _collect(self, wait: bool) -> bool:
        """Take in the verdicts of the audits handed to the audit thread: every one (`wait`, see _finish)
        or those that have one (an audit that failed raises here); whether none is still open."""
        with self._lock:
            pending = list(self._pending)
        ended = [j for j in pending if wait or j.future.done()]
        for job in ended:
            if wait:
                self._finish(job)
            else:
                job.future.result()
        with self._lock:
            self._pending = [j for j in self._pending if all(j is not e for e in ended)]
            return not self._pending

    def close(self) -> None:
        if self.projections is not None:
            self.projections.close()  # (its vectors' thread)
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)

    def _audit(self, address: str, call: Call, scope: Scope = Scope.SAMPLE) -> torch.Tensor | None:
        """None when the node's answer holds (its open calls are then checked), else the right rows (None too
        when some cannot be made here). A call whose drawn experts this coordinator cannot check (a slab it
        lacks, or one of its own that is damaged) settles as if it held: it is trusted, as with no audits,
        rather than left open for ever. `scope`: which rows (see Scope and the module docstring)."""
        picked = self._rows_to_check(call, scope)
        checked = call.expert_ids if picked is None else [expert for _, expert in picked]
        if not self.holds(call.layer, checked):  # (only the checked experts' slab files are read)
            self._checked(address, call, counted=False)
            return None
        if picked is None:
            own = self.expected(call.layer, checked, call.counts, call.rows)
            per_row = [e for e, n in zip(checked, call.counts, strict=True) for _ in range(n)]
            same = self._agrees(address, call.layer, per_row, call.rows, own, call.answer)
        else:
            idx = torch.tensor([row for row, _ in picked])
            rows = call.rows.index_select(0, idx)
            own_rows = self.expected(call.layer, checked, [1] * len(checked), rows)
            same = self._agrees(
                address, call.layer, checked, rows, own_rows, call.answer.index_select(0, idx)
            )
        with self._lock:
            again, call.audited = call.audited, True
        if again and same:  # checked twice (a settle took over from the audit thread): a pass counts once,
            return None  # a failure always (the two may have drawn different rows)
        if same or not self._ours_verify(call.layer, checked):
            self._checked(address, call, counted=same)  # (not same: our own slab is damaged, said once)
            return None
        with self._lock:
            self.report.audits += 1
        self._ban(
            address,
            f"its answer for layer {call.layer} experts {call.expert_ids} differs from the model's slabs",
        )
        if not self.holds(call.layer, call.expert_ids):
            return None  # the rows cannot all be made here: the settle redoes the pass without the node
        return self.expected(call.layer, call.expert_ids, call.counts, call.rows)

    def _audit_all(self, todo: list[tuple[str, Call]]) -> None:
        """Audit these calls now, half of them on the audit thread beside this one: a forced settle waits for
        them with nothing else to run, and copying cold slabs into the repacked layout (most of an audit's
        time) takes one core."""
        if self._worker is None or len(todo) < 2:
            for address, call in todo:
                self._audit(address, call, Scope.READY)
            return
        aside = [self._aside(a, c, Scope.READY) for a, c in todo[1::2]]
        try:
            with one_thread():
                for address, call in todo[0::2]:
                    self._audit(address, call, Scope.READY)
        finally:
            for job in aside:
                self._finish(job)

    def _checked(self, address: str, call: Call, counted: bool, projected: bool = False) -> None:
        with self._lock:
            self.report.projected += projected
            book = self._books.setdefault(address, NodeBook())
            self.report.audits += counted
            self.report.passed[address] += counted
            if book.last_call is call:
                book.open_calls = 0

    def _rows_to_check(self, call: Call, scope: Scope = Scope.SAMPLE) -> list[tuple[int, int]] | None:
        """(row, its expert) for one row of each of up to AUDIT_EXPERTS of the call's experts, all at random
        (None: check every row); `forced`: of its ready experts (up to AUDIT_EXPERTS), or of one when none
        is. Native numerics compute every row on its own (ggml multiplies row by row), so a row checked
        alone has the bits it had in the call; a damaged slab spoils every row of its expert, and a node
        cannot tell which of its experts a random check will take. Exact numerics (torch's float32 matmuls)
        check whole calls."""
        if self.numerics != Numerics.NATIVE or scope is Scope.EVERY_ROW:
            return None
        blocks, start = [], 0  # (first row, rows, expert) of each expert with rows
        for expert, n in zip(call.expert_ids, call.counts, strict=True):
            if n:
                blocks.append((start, n, expert))
            start += n
        most = AUDIT_EXPERTS
        if scope is Scope.EVERY_EXPERT:
            if start == len(blocks):
                return None
            most = len(blocks)
        elif scope is Scope.READY and blocks:
            ready = [b for b in blocks if self.store.ready(call.layer, b[2])]
            blocks = ready or [self._rng.choice(blocks)]
        elif start == len(blocks) <= AUDIT_EXPERTS:
            return None
        chosen = sorted(self._rng.sample(range(len(blocks)), min(most, len(blocks))))
        return [(blocks[i][0] + self._rng.randrange(blocks[i][1]), blocks[i][2]) for i in chosen]

    def _ban(self, address: str, why: str) -> None:
        with self._lock:
            if address in self.report.banned:
                return
            self.report.banned[address] = why
            self.report.calls_at_ban[address] = self._books[address].calls if address in self._books else 0
            self._caught = True
        log.error("banned node %s: %s", address, why)
        if self._on_ban is not None:
            self._on_ban(address)

    def is_banned(self, address: str) -> bool:
        return address in self.report.banned

    def settle(self, force: bool = False) -> Verdict:
        """What the answers since the last settle amount to (see the module docstring). Unforced, audits still
        running leave the work open (the model goes on meanwhile); forced, they are waited for."""
        self._project_all()
        all_in = self._collect(wait=force)
        if force:
            with self._lock:
                todo = [
                    (a, b.last_call)
                    for a, b in self._books.items()
                    if b.open_calls and b.last_call is not None
                ]
            self._audit_all([(a, c) for a, c in todo if c is not None and not self.is_banned(a)])
        with self._lock:
            if self._caught:
                self._caught = False
                for b in self._books.values():
                    b.open_calls = 0  # the work is redone: those answers are dropped
                return Verdict.CAUGHT
            open_ = any(b.open_calls for a, b in self._books.items() if a not in self.report.banned)
            return Verdict.OPEN if open_ or not all_in else Verdict.SETTLED


def _inner(address: str, inner: Any) -> np.ndarray:
    """A call's inner products as an array: `inner` itself, or read by it (a client's reply is decoded when
    it is checked); bytes that are no array give an empty one, which fails the check like a wrong shape."""
    if not callable(inner):
        return np.asarray(inner)
    try:
        return np.asarray(inner())
    except CodecError as e:
        log.warning("node %s sent inner products that are not an array: %s", address, e)
        return np.zeros((0, 0), np.float32)


def make_auditor(
    path: str | Path,
    config: EngineConfig,
    classes: dict[str, str] | None = None,
    on_ban: Callable[[str], None] | None = None,
) -> Auditor | None:
    """What checks the nodes' answers as `config` asks, on the coordinator's own slabs of the model at
    `path`; None (and a warning) when it has none here."""
    store = own_store(path)
    if store is None:
        log.warning("%s holds no expert slabs here: node answers cannot be audited", path)
        return None
    shard_dir = Path(path) if Path(path).is_dir() else None
    every_row = config.verify is Verify.ALL
    projections = Projections.started(store, config.audit_seed) if config.verify is Verify.PROJECT else None
    return Auditor(store, config.numerics, config.wire.dtype, config.sampled_rate, shard_dir, config.audit_seed,
                   every_row=every_row, classes=classes, on_ban=on_ban, projections=projections)  # fmt: skip
