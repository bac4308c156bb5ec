"""The coordinator's own answer to a node's call, and whether the node's answer agrees with it.

An honest node's answer equals, bit for bit, what the coordinator computes itself on the same slab bytes
(the two numerics guarantee it), so a check is an equality, not a tolerance; a node of another numerics
class gets the kernels' error bound instead (swarm.coordinator.checks.tolerance). The coordinator's own slabs
come from the model it was started on: a GGUF it trusts, or a shard directory. From a shard directory, an
answer that differs is a ban only once the coordinator's own slab files are checked against the manifest's
SHA-256 (one that is not is never used to check again): an answer that agrees needs no hashing, since it
agrees with bytes that only a damaged file of ours and an identically wrong node could both give.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from swarm.compute.expert_copies import within_cap
from swarm.compute.expert_weights import slab_dims
from swarm.compute.numclass import numerics_class, same_class
from swarm.compute.slabs import allow_open_files, load_slabs
from swarm.compute.store import ExpertStore
from swarm.coordinator.checks.tolerance import within_bound
from swarm.proto.numerics import Numerics
from swarm.sharding.manifest import EXPERTS_DIR
from swarm.sharding.slabs import ExpertSlab, LazySlabs, SlabKey

log = logging.getLogger(__name__)

_INT_OF = {4: torch.int32, 2: torch.int16, 1: torch.int8}
# The copies of experts audits keep, least recently used first out: repacked ones (native numerics, Q4_0 /
# Q4_K / IQ4_NL on x86: 1.8 MB an expert at the 35B shape) or float32 ones (exact). Without a bound they would
# grow towards the size of every expert the coordinator has ever checked.
AUDIT_MEMORY = 512 << 20


def own_store(path: str | Path) -> ExpertStore | None:
    """The coordinator's own slabs of the model at `path`, memory-mapped, or None where it has none: a shard
    directory's slab files each read on the first audit that draws it (LazySlabs: none at start), a GGUF's
    experts as views of its map. Neither is hashed here: a slab whose bytes an audit finds different is
    checked against the manifest before it counts."""
    slabs: Mapping[SlabKey, ExpertSlab]
    if Path(path).is_dir():
        if next((Path(path) / EXPERTS_DIR).rglob("*.gguf"), None) is None:
            return None
        slabs = LazySlabs(path, dims=slab_dims)
        allow_open_files(len(slabs))  # a file read is a descriptor kept: a long run's audits draw them all
    else:
        slabs = load_slabs(path, verify=False).slabs
    store = ExpertStore(slabs, torch.device("cpu"), within_cap(AUDIT_MEMORY), stacked=False)
    return store if store.slabs else None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two answers are the same bits: a NaN or an infinity an honest node computes (from rows a
    damaged node shaped earlier in the pass, say) equals the coordinator's own, where torch.equal would
    call NaN unequal to itself and ban every honest node that got such rows."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = _INT_OF[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


class Recomputer:
    """The coordinator's own slabs, what they answer, and whether a node's answer is an honest one."""

    def __init__(
        self,
        store: ExpertStore,
        numerics: Numerics,
        shard_dir: Path | None = None,
        classes: dict[str, str] | None = None,
    ) -> None:
        self.store = store  # the coordinator's own slabs (a shard directory's read as audits draw them)
        self.numerics = numerics
        self.shard_dir = shard_dir
        self._verified: dict[SlabKey, bool] = {}
        self._entries: dict[SlabKey, Any] | None = None  # the shard manifest's slab entries, read once
        self.own_class = numerics_class()  # this coordinator's ggml build (swarm.compute.numclass)
        # address -> the numerics class a node reported (the backend's own map: nodes that join later too)
        self.classes: dict[str, str] = {} if classes is None else classes

    def other_class(self, address: str) -> bool:
        """Whether a node computes in another numerics class than this coordinator (as _agrees reads it)."""
        return not same_class(self.classes.get(address, self.own_class), self.own_class)

    def holds(self, layer: int, expert_ids: list[int]) -> bool:
        """Whether every slab is here (and none failed its check against the manifest)."""
        return all(
            (layer, e) in self.store.slabs and self._verified.get((layer, e), True) for e in expert_ids
        )

    def _ours_verify(self, layer: int, expert_ids: list[int]) -> bool:
        """Whether these slabs of ours match the manifest (checked once each; a GGUF's always do): before an
        answer that differs from ours bans its node."""
        ok = True
        for e in expert_ids:
            key = (layer, e)
            if key not in self._verified:
                self._verified[key] = self._verify(key)
            ok = ok and self._verified[key]
        return ok

    def _verify(self, key: SlabKey) -> bool:
        if self.shard_dir is None:
            return True  # the coordinator's own GGUF
        from swarm.sharding.slabs import check_slab_file, read_manifest

        if self._entries is None:
            self._entries = {(s.layer, s.expert): s for s in read_manifest(self.shard_dir).slabs}
        entry = self._entries.get(key)
        problem = check_slab_file(self.shard_dir, entry) if entry is not None else "not in the manifest"
        if problem:
            log.warning("cannot audit with slab %d:%d of this coordinator: %s", key[0], key[1], problem)
        return problem is None

    def expected(
        self, layer: int, expert_ids: list[int], counts: list[int], rows: torch.Tensor
    ) -> torch.Tensor:
        out = self.store.compute(layer, expert_ids, counts, rows, self.numerics)
        return out.to(rows.dtype)

    def _agrees(
        self, address: str, layer: int, experts: list[int], rows: torch.Tensor, ours: torch.Tensor,
        theirs: torch.Tensor,
    ) -> bool:  # fmt: skip
        """Whether a node's answer is an honest one: the same bits from a node of this coordinator's numerics
        class, within the kernels' error bound (swarm.coordinator.checks.tolerance) from one of another class."""
        if same_bits(ours, theirs):
            return True
        if same_class(self.classes.get(address, self.own_class), self.own_class):
            return False
        exact = self.numerics != Numerics.NATIVE
        half = "fp16_va" in self.classes.get(address, "") or "fp16_va" in self.own_class
        return within_bound(self.store, layer, experts, rows, ours, theirs, exact, half)
