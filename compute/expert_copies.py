"""The copies an ExpertStore keeps of its experts, under one byte budget, least recently used first out.

Two kinds: the float32 working copies that exact calls (and slab types without a ggml kernel) multiply, and
the repacked copies of ggml's layout that native calls multiply one expert at a time (slab files; a whole
GGUF's stacked experts are one copy per layer, which the store keeps apart and unbounded). An evicted copy is
made again when a call needs it, with the same bits.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass

from swarm.compute.expert_weights import ExpertWeights
from swarm.compute.ffn import FFN
from swarm.sharding.slabs import SlabKey

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


def default_memory_budget() -> int:
    """Half of this machine's physical memory, for exact-numerics working copies: dequantized float32
    experts are 4-8x their quantized size, and a node that holds 64 experts of every layer of a 35B model
    would otherwise outgrow a laptop's RAM. (Native calls keep no copies.)"""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
    except (ValueError, OSError, AttributeError):
        return 0  # unknown: unlimited


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
        self.packed_bytes -= self.packed.pop(key, 0)
        w = self.float32.pop(key, None)
        if w is not None:
            self.float32_bytes -= w.nbytes

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
                    self.float32_bytes -= self.float32.pop(key).nbytes
                    self.evictions += 1
                else:
                    self.packed_bytes -= self.packed.pop(key)
                    self.native.pop(key, None)  # a call computing it holds its own reference
                log.debug("evicted the copy of expert %d of layer %d", key[1], key[0])
