"""Expert slabs held by one node (or in-process by the coordinator) and the SwiGLU compute over them.

Dimension letters: N rows, D model width, F expert width.
The quantized slab bytes stay memory-mapped. In the native numerics (the default) ggml multiplies them as
they are (swarm.compute), or, for the types this CPU has ggml's repacked kernels for (Q4_0, Q4_K, IQ4_NL
on x86), a repacked copy that replaces the slab's pages in memory (`prepare` makes them at start-up): what is
resident is the slab pages in use and those copies, no float32. The exact numerics multiplies float32
working copies, dequantized on first use; so does a slab type that ggml has no kernel for, whatever the call
asks (the forms: swarm.compute.expert_weights). Both kinds of copy are kept under one byte budget, least
recently used first out (swarm.compute.expert_copies). The store is shared by concurrent calls: one lock
guards only the cache bookkeeping, each expert has its own loading lock (two calls needing the same cold
expert dequantize it once), and the matmuls run outside any lock.

A whole call (every expert it names, one layer) is one ggml graph, and each row's result depends only on
that row and its expert's weights: the same on a node as in process, alone or beside other sequences.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from swarm.compute import ffn, pages
from swarm.compute.expert_copies import CacheStats, ExpertCopies
from swarm.compute.expert_weights import (
    ExpertWeights,
    copied_bytes,
    dequantize_expert,
    find_stack,
    multiplied_in_place,
    native_ffn,
    slab_dims,
)
from swarm.compute.ffn import FFN
from swarm.compute.graph import Array, empty_rows, f32_rows
from swarm.proto.arrays import as_given, f32_values, to_numpy
from swarm.proto.numerics import Numerics
from swarm.sharding.ranges import format_ranges
from swarm.sharding.slabs import ExpertSlab, LazySlabs, SlabKey

log = logging.getLogger(__name__)


# A coordinator that has to cut one expert's rows over several calls cuts at multiples of this. ggml's rows
# are independent, so any cut gives the same bits; the unit only keeps the pieces of a long prefill even.
ROWS_PER_MATMUL = 1024


_UNSET = object()


class MissingSlabs(KeyError):
    """A call named slabs this store does not hold."""

    def __init__(self, layer: int, experts: Sequence[int], held_layers: Sequence[int]) -> None:
        self.layer = layer
        self.experts = list(experts)
        self.held_layers = list(held_layers)
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.layer not in self.held_layers:
            return (
                f"layer {self.layer} is not held here (this node holds layers "
                f"{_fmt(self.held_layers)}); send it to a node that holds it"
            )
        return (
            f"expert(s) {_fmt(self.experts)} of layer {self.layer} are not held here; "
            "send them to a node that holds them (see Info)"
        )


class BadCall(ValueError):
    """A call whose ids, counts or rows do not fit together."""


def _fmt(ids: Sequence[int]) -> str:
    return format_ranges(ids) if ids else "none"


class ExpertStore:
    """The slabs one process holds, computing any of them on request.

    `memory_budget` bounds the copies this store keeps, least recently used first out (None or 0:
    unlimited): the dequantized float32 working copies that exact calls (and slab types without a ggml kernel)
    make, and the repacked copies native calls multiply one expert at a time (slab files; a whole GGUF's
    stacked experts are one copy per layer, not bounded). An evicted expert is copied again when a call needs
    it, with the same bits. The experts a call is computing stay alive until it ends, so a budget smaller than
    one expert still works. `device`: where exact calls compute (a GPU runs them with torch); native calls
    always run ggml's CPU kernels. `stacked=False`: per-expert copies only (a layer's whole stack is not
    copied to compute a few of its experts). `slabs` may be a LazySlabs (a coordinator's audit slabs): each
    slab file is then read on its first use, and nothing of them is touched here.
    """

    def __init__(
        self,
        slabs: Mapping[SlabKey, ExpertSlab],
        device: str = "cpu",
        memory_budget: int | None = None,
        stacked: bool = True,
    ) -> None:
        self.slabs = slabs
        self.stacked = stacked  # False: per-expert copies even where the GGUF stacks them (what audits use)
        self.device = str(device)  # exact calls on a GPU need torch (swarm.compute.device_experts)
        self.memory_budget = int(memory_budget or 0)
        lazy = isinstance(slabs, LazySlabs)  # read on first use: nothing of them is touched here
        dims = {} if lazy else {key: slab_dims(key, parts) for key, parts in slabs.items()}
        widths = {slabs.manifest.n_embd} if lazy else {d for d, _ in dims.values()}
        if len(widths) > 1:
            raise ValueError(
                f"slabs disagree on the model width D: {sorted(widths)}; they are from different models"
            )
        self.hidden_size: int | None = widths.pop() if widths else None
        self._experts_of: dict[int, set[int]] = {}
        for layer, expert in slabs:
            self._experts_of.setdefault(layer, set()).add(expert)
        self._lock = threading.Lock()  # guards the copies and the replacing of the slab tables only
        self._load_locks = {key: threading.Lock() for key in slabs}
        self._copies = ExpertCopies(self.memory_budget)
        self._stacks: dict[int, ffn.ExpertStack | None] = {}  # per layer, where the GGUF stacks them
        self._stack_lock = threading.Lock()
        # the slab pages are mapped in while the process starts up, not one fault at a time in the first calls
        # (not those that native calls multiply as a repacked copy: they are read once, by `prepare`)
        if not lazy:
            pages.populate(multiplied_in_place(slabs.values()))
        self._dropped: frozenset[SlabKey] = frozenset()
        # called with a call's (layer, expert ids) once they are known held, before any of their bytes are
        # used: a node hashes each slab against its manifest there before its first call (swarm.node.first_use)
        self.before_use: Callable[[int, Sequence[int]], None] | None = None

    def add(self, key: SlabKey, parts: ExpertSlab) -> None:
        """Serve one more slab from now on (a fetched slab, once it verified). Calls in flight read the
        slab tables without a lock, so each table is replaced whole, never changed under them."""
        d, _ = slab_dims(key, parts)
        layer, expert = key
        with self._lock:
            if self.hidden_size is not None and d != self.hidden_size:
                raise ValueError(
                    f"slab {layer}:{expert} is {d} wide but the other slabs are {self.hidden_size}; "
                    "it is from another model"
                )
            self._load_locks.setdefault(key, threading.Lock())
            self._experts_of = {**self._experts_of, layer: self._experts_of.get(layer, set()) | {expert}}
            self.slabs = {**self.slabs, key: parts}
            self._dropped = self._dropped - {key}
            self._forget(key)
            self.hidden_size = d
        pages.populate(multiplied_in_place([parts]), background=False)  # the caller's thread: one slab

    def remove(self, key: SlabKey) -> bool:
        """Serve this slab no more (its file failed its check): a call for it is refused from now on exactly
        as one for a slab never held (MissingSlabs), and `dropped()` names it until `add` takes it back. Each
        table is replaced whole, as `add` does; a call already multiplying it keeps its own reference to the
        bytes and ends. False when it was not held."""
        layer, expert = key
        with self._lock:
            if key not in self.slabs:
                return False
            rest = self._experts_of.get(layer, set()) - {expert}
            self._experts_of = {n: es for n, es in {**self._experts_of, layer: rest}.items() if es}
            self.slabs = {k: v for k, v in self.slabs.items() if k != key}
            self._dropped = self._dropped | {key}
            self._forget(key)
        return True

    def _forget(self, key: SlabKey) -> None:
        """Drop every copy made from this slab's old bytes (repacked, float32, its layer's stack). Under
        self._lock."""
        self._stacks.pop(key[0], None)
        self._copies.forget(key)

    def dropped(self) -> list[SlabKey]:
        """The slabs `remove` took out of service (and `add` has not taken back)."""
        return sorted(self._dropped)

    def held(self) -> list[SlabKey]:
        return sorted(self.slabs)

    def holds(self, layer: int, expert: int) -> bool:
        """Whether this store holds the slab, by its list (a lazily read slab file is not read to tell)."""
        return expert in self._experts_of.get(layer, ())

    def layers(self) -> list[int]:
        return sorted(self._experts_of)

    def cache_stats(self) -> CacheStats:
        with self._lock:
            return self._copies.stats()

    def weights(self, layer: int, expert: int) -> ExpertWeights:
        """The working copy of one expert, dequantizing it if it is not resident."""
        key = (layer, expert)
        parts = self._parts(key)
        with self._lock:
            w = self._copies.hit(key)
        if w is not None:
            return w
        with self._load_locks[key]:
            with self._lock:  # another call may have loaded it while this one waited
                w = self._copies.hit(key)
                if w is not None:
                    return w
                self._copies.misses += 1
            w = dequantize_expert(parts, self.device)
            with self._lock:
                if self.slabs.get(key) is parts:  # not removed (or replaced) while it was copied
                    self._copies.keep_float32(key, w)
        return w

    def _parts(self, key: SlabKey) -> ExpertSlab:
        """The slab's parts; MissingSlabs when it is not held (never held, or removed)."""
        parts = self.slabs.get(key)
        if parts is None:
            raise MissingSlabs(key[0], [key[1]], self.layers())
        return parts

    def check(self, layer: int, expert_ids: Sequence[int], counts: Sequence[int], rows: Array) -> None:
        """Raise BadCall or MissingSlabs when a call does not fit this store; do nothing otherwise."""
        if len(expert_ids) != len(counts):
            raise BadCall(
                f"{len(expert_ids)} expert ids but {len(counts)} counts; send one row count per expert id"
            )
        if any(c < 0 for c in counts):
            raise BadCall(f"negative row count in {list(counts)}")
        if len(rows.shape) != 2:
            raise BadCall(f"rows have shape {list(rows.shape)}; send a 2-D [N, D] tensor")
        n = sum(counts)
        if rows.shape[0] != n:
            raise BadCall(f"rows have {rows.shape[0]} rows but the counts sum to {n}; send sum(counts) rows")
        if self.hidden_size is not None and rows.shape[1] != self.hidden_size:
            raise BadCall(
                f"rows are {rows.shape[1]} wide but this model's width D is {self.hidden_size}; "
                "check that the node serves the same model (fingerprint)"
            )
        self._check_held(layer, expert_ids)
        if self.before_use is not None:
            self.before_use(layer, expert_ids)

    def _check_held(self, layer: int, expert_ids: Iterable[int]) -> None:
        """Raise MissingSlabs naming the experts of `layer` this store does not hold."""
        held = self._experts_of.get(layer, set())
        missing = sorted({e for e in expert_ids if e not in held})
        if missing:
            raise MissingSlabs(layer, missing, self.layers())

    def ffn(self, layer: int, expert: int, numerics: Numerics = Numerics.NATIVE) -> FFN:
        """One expert as ggml multiplies it: its slab bytes (native) or its float32 working copy (exact,
        or a slab type without a ggml kernel)."""
        key = (layer, expert)
        if key not in self.slabs:
            raise MissingSlabs(layer, [expert], self.layers())
        if numerics == Numerics.NATIVE:
            f = self._native_ffn(key)
            if f is not None:
                return f
        return self.weights(layer, expert).ffn()

    def _native_ffn(self, key: SlabKey) -> FFN | None:
        """The expert as native calls multiply it (None: a type without a ggml kernel); a repacked copy is
        made on first use, or again after the budget evicted it."""
        copies = self._copies
        f = copies.native.get(key, _UNSET)
        if f is _UNSET:
            with self._load_locks[key]:  # two calls needing the same new expert repack it once
                f = copies.native.get(key, _UNSET)
                if f is _UNSET:
                    parts = self._parts(key)
                    f = native_ffn(parts)
                    with self._lock:
                        if self.slabs.get(key) is parts:  # not removed (or replaced) while it was copied
                            copies.keep_native(key, f)
        elif key in copies.packed:
            with self._lock:
                copies.touch_native(key)
        return f  # type: ignore[return-value]

    def ready(self, layer: int, expert: int) -> bool:
        """Whether native calls of this expert find it as they multiply it (its repacked copy made and not
        evicted, or its bytes in place), with nothing to copy first."""
        return (layer, expert) in self._copies.native

    def stack(self, layer: int) -> ffn.ExpertStack | None:
        """This layer's experts as one stack per matrix, when they lie back to back as a whole GGUF's stacked
        tensors do (a shard directory's slab files do not): then one mul_mat_id multiplies them all."""
        if not self.stacked:
            return None
        stack = self._stacks.get(layer, _UNSET)
        if stack is _UNSET:
            with self._stack_lock:
                stack = self._stacks.get(layer, _UNSET)
                if stack is _UNSET:
                    slabs = self.slabs
                    parts = {e: slabs.get((layer, e)) for e in self._experts_of.get(layer, ())}
                    if not parts or any(p is None for p in parts.values()):
                        return None  # a slab added or removed meanwhile: the next call looks again
                    stack = self._stacks[layer] = find_stack(layer, parts)  # type: ignore[arg-type]
        return stack  # type: ignore[return-value]

    def prepare(self) -> None:
        """Put every held expert in the form native calls multiply it in (ggml's repacked layout, where this
        CPU has one for its type: a copy that replaces the slab's pages in memory) now rather than on its
        first use: a start-up cost, as llama.cpp's load has, not a slow first prompt. Within the memory
        budget: past it, the remaining experts are repacked when calls need them."""
        made = total = 0
        for layer in self.layers():
            if self.stack(layer) is not None:
                continue
            for expert in sorted(self._experts_of[layer]):
                total += 1
                made += self.prepare_expert(layer, expert)
        self.say_unprepared(made, total)

    def say_unprepared(self, made: int, total: int) -> None:
        """Warn when only `made` of `total` experts fit the memory budget as their copies."""
        if made < total:
            log.warning(
                "%d of %d experts fit the memory budget (%.1f GiB) as ggml's repacked copies; the others are "
                "copied when a call needs them (slower calls): give more memory (--memory) to keep them all",
                made, total, self.memory_budget / 2**30,
            )  # fmt: skip

    def prepare_expert(self, layer: int, expert: int) -> bool:
        """Put one held expert in the form native calls multiply it in now, if the memory budget has room for
        its copy; whether it is ready (False: not held any more, or no room)."""
        key = (layer, expert)
        parts = self.slabs.get(key)
        if parts is None:
            return False
        if key not in self._copies.native and not self._copies.fits(copied_bytes(parts)):
            return False
        self.ffn(layer, expert, Numerics.NATIVE)
        return True

    def compute(
        self,
        layer: int,
        expert_ids: Sequence[int],
        counts: Sequence[int],
        rows: Array,
        numerics: Numerics = Numerics.NATIVE,
    ) -> Array:
        """Rows packed expert-major (counts[i] rows for expert_ids[i]) -> outputs [N, D] float32 in the same
        order, the same kind of array as `rows` (numpy on a node; torch from the coordinator)."""
        return self._compute(layer, expert_ids, counts, rows, numerics, None)

    def compute_inner(
        self,
        layer: int,
        expert_ids: Sequence[int],
        counts: Sequence[int],
        rows: Array,
        numerics: Numerics = Numerics.NATIVE,
    ) -> tuple[Array, np.ndarray]:
        """`compute`'s outputs, and each row's gate and up products [N, 2F] float32 (gate first) as the same
        graph computed them: what a coordinator checks an answer with (swarm.coordinator.checks.projection).
        On the CPU only (ggml's kernels: exact numerics on a GPU give no inner products)."""
        if numerics == Numerics.EXACT and self.device != "cpu":
            raise BadCall("inner products are computed on the CPU; ask an exact node on a GPU for none")
        self.check(layer, expert_ids, counts, rows)
        widths = {self.ffn_width(layer, e) for e, n in zip(expert_ids, counts, strict=True) if n}
        if len(widths) > 1:
            raise BadCall(f"experts of layer {layer} differ in width ({sorted(widths)}); inner products need one")
        inner = np.empty((int(rows.shape[0]), 2 * (widths.pop() if widths else 0)), np.float32)
        return self._compute(layer, expert_ids, counts, rows, numerics, inner), inner

    def ffn_width(self, layer: int, expert: int) -> int:
        """F: the width of an expert's gate and up products."""
        return slab_dims((layer, expert), self._parts((layer, expert)))[1]

    def _compute(
        self,
        layer: int,
        expert_ids: Sequence[int],
        counts: Sequence[int],
        rows: Array,
        numerics: Numerics,
        inner: np.ndarray | None,
    ) -> Array:
        if inner is None:
            self.check(layer, expert_ids, counts, rows)
        if numerics not in tuple(Numerics):
            raise BadCall(f"unknown numerics {numerics!r}; use one of {', '.join(tuple(Numerics))}")
        if numerics == Numerics.EXACT and self.device != "cpu":
            from swarm.compute.device_experts import compute_on_device

            out = compute_on_device(
                lambda e: self.weights(layer, e), self.device, list(expert_ids), list(counts), rows
            )
            return out if not isinstance(rows, np.ndarray) else out.cpu().numpy()
        x = f32_values(to_numpy(rows))
        out = np.empty_like(x)
        stack = self.stack(layer) if numerics == Numerics.NATIVE else None
        if stack is not None:
            ids = np.repeat(np.asarray(expert_ids, np.int32), np.asarray(counts, np.int64))
            ffn.moe_rows(stack, ids[:, None], x, out, inner)
            return as_given(out, rows)
        # in rounds whose copies fit the memory budget when the call's do not (swarm.compute.expert_copies)
        todo, start, native, copies, slabs = [], 0, numerics == Numerics.NATIVE, self._copies, self.slabs
        for expert, n in zip(expert_ids, counts, strict=True):
            if n:
                todo.append(((layer, expert), start, n))
            start += n
        sizes = [copies.size(k, slabs[k], native) if k in slabs else 0 for k, _, _ in todo if copies.budget]
        rounds = copies.rounds(todo, sizes, native)
        with copies.split_lock if len(rounds) > 1 else contextlib.nullcontext():
            for part in rounds:
                blocks = [(self.ffn(layer, k[1], numerics), a, n) for k, a, n in part]
                ffn.ffn_rows(blocks, x, out, inner)
                if len(rounds) > 1:
                    del blocks  # this round's copies, evicted for the next round's, are freed now
                    with self._lock:
                        copies.hand_back()
        return as_given(out, rows)

    def held_stack(self, layer: int, ids: Array) -> ffn.ExpertStack | None:
        """This layer's experts as one stack (None when they do not lie stacked), after checking that every
        expert of ids is held here."""
        stack = self.stack(layer)
        if stack is not None:
            self._check_held(layer, ids.reshape(-1).tolist())
        return stack

    def compute_slots(self, layer: int, x: Array, ids: Array) -> Array | None:
        """Native numerics, in process: every token's K experts, x [T, D], ids [T, K] -> [T, K, D], with no
        packing when this layer's experts lie stacked (else None: use `compute`). The same bits as `compute`
        of the same pairs, on a node or here."""
        on_cpu = isinstance(x, np.ndarray) or x.device.type == "cpu"
        stack = self.held_stack(layer, ids) if on_cpu else None
        if stack is None:
            return None
        x = f32_rows(x)
        out = empty_rows(x, (x.shape[0], ids.shape[1], x.shape[1]))
        ffn.moe_rows(stack, ids, x, out)
        return out
