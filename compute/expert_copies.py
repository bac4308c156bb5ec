"""The copies an ExpertStore keeps of its experts, under one byte budget, least recently used first out.

Two kinds: the float32 working copies that exact calls (and slab types without a ggml kernel) multiply, and
the repacked copies of ggml's layout that native calls multiply one expert at a time (slab files; a whole
GGUF's stacked experts are one copy per layer, which the store keeps apart and unbounded). An evicted copy is
made again when a call needs it, with the same bits.

The budget bounds what a process holds, calls included, so that a node under a memory cap (a phone app, a
container: swarm.compute.cgroup) stays under it rather than being killed:

- A call multiplies its experts' copies at once, and a copy a call holds cannot be freed while it runs: a
  prefill naming every expert of a layer would hold the whole layer's copies whatever the budget. A call whose
  copies outgrow the budget is multiplied in rounds that fit it (`rounds`), the copies of a round evicted for
  the next one's. Each row's result depends only on that row and its expert's weights, so the rounds give the
  bits of one graph. ggml's repacked kernels do not give the bits of its plain ones (their sums run in
  another order), so multiplying an expert from its memory-mapped slab instead of a copy is no way out.
- glibc keeps freed memory in its heap and, for copies of this size, mostly does not reuse it for the next
  ones: two calls naming every expert of a layer leave 360 MiB of copies in a 760 MiB heap, all of it
  resident. The memory of evicted copies is handed back to the kernel (`malloc_trim`) every TRIM_STEP bytes
  evicted and after each round.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from swarm.compute.cgroup import MemoryCap, memory_cap, physical_memory
from swarm.compute.expert_weights import ExpertWeights, call_bytes
from swarm.compute.ffn import FFN
from swarm.sharding.slabs import ExpertSlab, SlabKey

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheStats:
    """The float32 working copies (hits, misses, evictions, resident_*) and the repacked copies (repacked_*)."""

    hits: int
    misses: int
    evictions: int
    resident_bytes: int
    resident_experts: int
    repacked_bytes: int = 0
    repacked_experts: int = 0
    repacks: int = 0  # repacked copies made (more than the experts held once the budget evicts some)


# Under a memory cap: what a process adds after choosing its budget (a node's ggml library, gRPC and its
# threads, the rows and outputs of calls in flight; a coordinator's activations), and a margin below the cap
# for what the kernel charges beside it: the page cache of the slab bytes calls read (multiplied in place, or
# read to be repacked), page tables, socket buffers. Past the cap the kernel reclaims page cache first and
# then kills the process, so the copies (anonymous memory) must leave this much of it.
LATER_BYTES = 160 << 20
MARGIN_FRACTION = 8  # an eighth of the cap
MIN_MARGIN = 64 << 20
MIN_BUDGET = 1 << 20  # a budget smaller than one expert still works: every call copies its experts again
TRIM_STEP = 16 << 20  # evicted bytes after which the heap hands freed memory back to the kernel


def default_memory_budget() -> int:
    """The budget for the copies of experts one process keeps: half of this machine's physical memory
    (dequantized float32 experts are 4-8x their quantized size, and a node that holds 64 experts of every
    layer of a 35B model would otherwise outgrow a laptop's RAM), or, under a cgroup memory limit that
    leaves less (a phone's app, a container), the limit less what the group holds now (anonymous memory),
    LATER_BYTES and a margin. Logs what it chose and why."""
    half = physical_memory() // 2  # 0: unknown, unlimited
    cap = memory_cap()
    if cap is None:
        log.info("memory budget %s: half of this machine's RAM (no cgroup memory limit)", _mib(half))
        return half
    margin = _margin(cap)
    room = cap.limit - cap.anon - LATER_BYTES - margin
    if half and room >= half:
        log.info("memory budget %s: half of this machine's RAM (below the %s)", _mib(half), cap.describe())
        return half
    budget = max(room, MIN_BUDGET)
    log.warning(
        "memory budget %s for copies of experts, sized to the %s: less %s of anonymous memory its group "
        "holds now, %s this process adds while serving and a %s margin for the slab pages calls read%s",
        _mib(budget), cap.describe(), _mib(cap.anon), _mib(LATER_BYTES), _mib(margin),
        "" if room >= MIN_BUDGET else "; that leaves no room: every call copies its experts again (slow), "
        "give the group more memory or this node fewer slabs",
    )  # fmt: skip
    return budget


def within_cap(wanted: int, share: int = 2) -> int:
    """`wanted` bytes of copies, or less under a cgroup memory limit that leaves less room: 1/`share` of the
    limit less what the group holds now, LATER_BYTES and the margin (a coordinator's audit copies, beside
    the model it is still loading: its own share of the room, not all of it)."""
    cap = memory_cap()
    if cap is None:
        return wanted
    room = cap.limit - cap.anon - LATER_BYTES - _margin(cap)
    budget = max(MIN_BUDGET, room // share)
    if budget >= wanted:
        return wanted
    log.warning("%s for copies of experts instead of %s: the %s leaves no more", _mib(budget), _mib(wanted),
                cap.describe())  # fmt: skip
    return budget


def _margin(cap: MemoryCap) -> int:
    """What a process leaves free below its cap for what the kernel charges beside its copies."""
    return max(MIN_MARGIN, cap.limit // MARGIN_FRACTION)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n else "unlimited"


class ExpertCopies:
    """The copies of one store's experts and their counters. It takes no lock of its own: the store calls it
    under the lock that also guards its slab tables, so that it never keeps a copy of a slab removed (or
    replaced) while the copy was made. `budget` 0: unlimited."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.float32: OrderedDict[SlabKey, ExpertWeights] = OrderedDict()
        self.float32_bytes = 0
        self.native: dict[SlabKey, FFN | None] = {}  # views of the slab bytes, or repacked copies
        self.packed: OrderedDict[SlabKey, int] = OrderedDict()  # the repacked ones: bytes, LRU order
        self.packed_bytes = 0
        self.hits = self.misses = self.evictions = self.repacks = 0
        self.unreturned = 0  # bytes of copies dropped since the heap last handed freed memory back
        self._sizes: dict[tuple[SlabKey, bool], int] = {}  # call_bytes of each expert, native or not
        # a call split in rounds holds up to a budget of copies: two at once would hold twice that
        self.split_lock = threading.Lock()

    def stats(self) -> CacheStats:
        return CacheStats(
            self.hits, self.misses, self.evictions, self.float32_bytes, len(self.float32),
            self.packed_bytes, len(self.packed), self.repacks,
        )  # fmt: skip

    def hit(self, key: SlabKey) -> ExpertWeights | None:
        """The float32 copy of this expert, counted as a hit and made the most recently used; None if none."""
        w = self.float32.get(key)
        if w is not None:
            self.float32.move_to_end(key)
            self.hits += 1
        return w

    def keep_float32(self, key: SlabKey, w: ExpertWeights) -> None:
        self.float32[key] = w
        self.float32_bytes += w.nbytes
        self.evict_over_budget(keep=key)

    def keep_native(self, key: SlabKey, f: FFN | None) -> None:
        """The expert as native calls multiply it; what of it is a repacked copy counts against the budget."""
        self.native[key] = f
        copied = sum(w.nbytes for w in f.matrices if w.repack is not None) if f else 0
        if copied:
            self.packed[key] = copied
            self.packed_bytes += copied
            self.repacks += 1
            self.evict_over_budget(keep=key)

    def touch_native(self, key: SlabKey) -> None:
        """Make the repacked copy of this expert (if it has one) the most recently used."""
        if key in self.packed:
            self.packed.move_to_end(key)

    def fits(self, size: int) -> bool:
        """Whether `size` bytes more stay within the budget."""
        return not self.budget or not size or self.float32_bytes + self.packed_bytes + size <= self.budget

    def forget(self, key: SlabKey) -> None:
        """Drop every copy made of this expert's slab (its old bytes)."""
        self.native.pop(key, None)
        packed = self.packed.pop(key, 0)
        self.packed_bytes -= packed
        w = self.float32.pop(key, None)
        if w is not None:
            self.float32_bytes -= w.nbytes
        self.unreturned += packed + (w.nbytes if w is not None else 0)
        self._sizes.pop((key, True), None)
        self._sizes.pop((key, False), None)

    def size(self, key: SlabKey, slab: ExpertSlab, native: bool) -> int:
        """The bytes of the copy a call multiplies this expert as (expert_weights.call_bytes, remembered)."""
        size = self._sizes.get((key, native))
        if size is None:
            size = self._sizes[(key, native)] = call_bytes(slab, native)
        return size

    def held(self, key: SlabKey, native: bool) -> bool:
        """Whether the copy a call in these numerics multiplies this expert as is kept now."""
        return key in (self.native if native else self.float32)

    def rounds(
        self, blocks: Sequence[tuple[SlabKey, int, int]], sizes: Sequence[int], native: bool
    ) -> list[list[tuple[SlabKey, int, int]]]:
        """A call's blocks (expert, first row, rows) in the groups it multiplies at once: all of them as
        given when their copies (`sizes`, bytes) fit the budget, else those kept now first (nothing to copy),
        then the others, each round within the budget (one expert at least)."""
        if not self.budget or sum(sizes) <= self.budget:
            return [list(blocks)]
        order = sorted(range(len(blocks)), key=lambda i: not self.held(blocks[i][0], native))
        rounds: list[list[tuple[SlabKey, int, int]]] = [[]]
        size = 0
        for i in order:
            if rounds[-1] and size + sizes[i] > self.budget:
                rounds.append([])
                size = 0
            rounds[-1].append(blocks[i])
            size += sizes[i]
        return rounds

    def hand_back(self, step: int = 0) -> None:
        """Once more than `step` bytes of copies were dropped since the last time, have the heap hand its
        freed memory back to the kernel (glibc; nothing elsewhere)."""
        if self.unreturned > step:
            self.unreturned = 0
            _malloc_trim()

    def evict_over_budget(self, keep: SlabKey) -> None:
        """Drop the least recently used copies (float32 ones first: only exact calls use them) until what is
        kept fits the budget; never `keep`, the copy just made."""
        if not self.budget:
            return
        for cache in (self.float32, self.packed):
            for key in [k for k in cache if k != keep]:
                if self.float32_bytes + self.packed_bytes <= self.budget:
                    return
                if cache is self.float32:
                    size = self.float32.pop(key).nbytes
                    self.float32_bytes -= size
                    self.evictions += 1
                else:
                    size = self.packed.pop(key)
                    self.packed_bytes -= size
                    self.native.pop(key, None)  # a call computing it holds its own reference
                self.unreturned += size
                log.debug("evicted the copy of expert %d of layer %d", key[1], key[0])
                self.hand_back(TRIM_STEP)


_trim: list[object] = []  # [glibc's malloc_trim, or None]


def _malloc_trim() -> None:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim(0): also the pages of free chunks
    inside the heap, not only at its top)."""
    if not _trim:
        fn = None
        if sys.platform.startswith("linux"):
            try:  # the process's own symbols, libc's among them
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):  # a libc without it (musl)
                fn = None
        _trim.append(fn)
    if _trim[0] is not None:
        _trim[0](0)  # type: ignore[operator]
