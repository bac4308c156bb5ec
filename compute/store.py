"""Expert slabs held by one node (or in-process by the coordinator) and the SwiGLU compute over them.

Dimension letters: N rows, D model width, F expert width.
The quantized slab bytes stay memory-mapped. In the native numerics (the default) ggml multiplies them as
they are (swarm.compute), or, for the types this CPU has ggml's repacked kernels for (Q4_0, Q4_K, IQ4_NL
on x86), a repacked copy that replaces the slab's pages in memory (`prepare` makes them at start-up): what is
resident is the slab pages in use and those copies, no float32. The
exact numerics multiplies float32 working copies, dequantized on first use; so does a slab type that ggml
has no kernel for, whatever the call asks. Both kinds of copy are kept under one byte budget, least recently
used first out (a call that needs an evicted expert copies it again, with the same bits). The store is shared by concurrent calls: one
lock guards only the cache bookkeeping, each expert has its own loading lock (two calls needing the same
cold expert dequantize it once), and the matmuls run outside any lock.

A whole call (every expert it names, one layer) is one ggml graph, and each row's result depends only on
that row and its expert's weights: the same on a node as in process, alone or beside other sequences.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from swarm.compute import ffn, pages, probes, weights
from swarm.compute.dequant import dequantize
from swarm.compute.ffn import FFN
from swarm.compute.numerics import Numerics
from swarm.compute.weights import Weight
from swarm.sharding.ranges import format_ranges
from swarm.sharding.slabs import LazySlabs, SlabKey, SlabTensor

log = logging.getLogger(__name__)

GATE, UP, DOWN, GATE_UP = "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"


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


@dataclass
class ExpertWeights:
    """Dequantized weights of one expert: gate and up fused as gate_up [2F, D] (gate rows first), down [D, F].

    Fusing gate and up makes one matmul of the first two; F.linear takes them as stored ([out, in]),
    which measured as fast as a pre-transposed copy on CPU.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def gate(self) -> torch.Tensor:
        return self.gate_up[: self.gate_up.shape[0] // 2]

    @property
    def up(self) -> torch.Tensor:
        return self.gate_up[self.gate_up.shape[0] // 2 :]

    @property
    def nbytes(self) -> int:
        ts = (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def ffn(self) -> FFN:
        """These float32 weights for ggml's F32 kernel (CPU only)."""
        return FFN(
            down=Weight.of_float(self.down),
            gate_up=Weight.of_float(self.gate_up),
            gate_bias=self.gate_up_bias,
            down_bias=self.down_bias,
        )


def _load(s: SlabTensor, device: torch.device) -> torch.Tensor:
    return dequantize(s.data, s.qtype, s.shape).to(device)


def _load_pair(first: SlabTensor, second: SlabTensor, device: torch.device) -> torch.Tensor:
    """Two slabs stacked on dim 0, each dequantized straight into its half (no torch.cat copy)."""
    rows = first.shape[0]
    pair = torch.empty((rows + second.shape[0], *first.shape[1:]), dtype=torch.float32)
    dequantize(first.data, first.qtype, first.shape, out=pair[:rows])
    dequantize(second.data, second.qtype, second.shape, out=pair[rows:])
    return pair.to(device)


def dequantize_expert(parts: dict[str, SlabTensor], device: torch.device | str = "cpu") -> ExpertWeights:
    """One expert's slabs (quantized, memory-mapped) -> float32 working weights on `device`."""
    device = torch.device(device)
    if GATE_UP in parts:
        gate_up = _load(parts[GATE_UP], device)
        gu_bias = _load(parts[GATE_UP + ".bias"], device) if GATE_UP + ".bias" in parts else None
    else:
        gate_up = _load_pair(parts[GATE], parts[UP], device)
        gu_bias = None
        if GATE + ".bias" in parts and UP + ".bias" in parts:
            gu_bias = _load_pair(parts[GATE + ".bias"], parts[UP + ".bias"], device)
    down_bias = _load(parts[DOWN + ".bias"], device) if DOWN + ".bias" in parts else None
    return ExpertWeights(gate_up.contiguous(), _load(parts[DOWN], device).contiguous(), gu_bias, down_bias)


def native_ffn(parts: dict[str, SlabTensor]) -> FFN | None:
    """One expert's slabs as ggml multiplies them in place; None when a part's type has no ggml kernel."""
    for s in parts.values():
        if not s.kind.endswith(".bias") and not probes.has_kernel(s.qtype):
            probes.warn_no_kernel(int(s.qtype), f"expert slab {s.kind}")
            return None

    def w(kind: str) -> Weight | None:
        s = parts.get(kind)
        return weights.repacked(Weight.of_bytes(s.data, s.qtype, s.shape)) if s is not None else None

    def bias(kind: str) -> torch.Tensor | None:
        s = parts.get(kind + ".bias")
        return dequantize(s.data, s.qtype, s.shape).contiguous() if s is not None else None

    down = w(DOWN)
    assert down is not None
    if GATE_UP in parts:
        return FFN(down=down, gate_up=w(GATE_UP), gate_bias=bias(GATE_UP), down_bias=bias(DOWN))
    return FFN(
        down=down, gate=w(GATE), up=w(UP), gate_bias=bias(GATE), up_bias=bias(UP), down_bias=bias(DOWN)
    )


def _copied_bytes(parts: dict[str, SlabTensor]) -> int:
    """The bytes of one expert's parts that native calls multiply as a repacked copy (resident memory)."""
    return sum(s.data.nbytes for s in parts.values() if not _in_place(s))


def _in_place(s: SlabTensor) -> bool:
    rows = int(np.prod(s.shape[:-1])) if len(s.shape) > 1 else 1
    return s.kind.endswith(".bias") or not weights.repackable(int(s.qtype), rows)


def _find_stack(layer: int, experts: dict[int, dict[str, SlabTensor]]) -> ffn.ExpertStack | None:
    """The ExpertStack of one layer's held experts, or None when their slabs are not back to back in one
    mapping (slab files), carry biases, or have a type without a ggml kernel."""
    first = next(iter(experts.values()))
    kinds = sorted(first)
    if any(k.endswith(".bias") for k in kinds) or any(sorted(p) != kinds for p in experts.values()):
        return None
    n_stack, lo = max(experts) + 1, min(experts)
    e0 = next(iter(experts))
    stacks: dict[str, Weight] = {}
    for kind in kinds:
        ref = first[kind]
        if not probes.has_kernel(ref.qtype):
            return None
        w = Weight.of_bytes(ref.data, ref.qtype, ref.shape)
        base, owner = w.ptr - e0 * w.nbytes, ref.data.base
        # every expert's slab of this kind at its place in one stack: a layer holds hundreds, so compare
        # addresses rather than build a Weight per slab (a cold first call pays for each)
        for e, parts in experts.items():
            s = parts[kind]
            arr = s.data
            if (
                s.qtype != ref.qtype
                or s.shape != ref.shape
                or arr.base is not owner
                or arr.nbytes != w.nbytes
                or not arr.flags.c_contiguous
                or arr.__array_interface__["data"][0] != base + e * w.nbytes
            ):
                return None
        stacks[kind] = Weight(w.qtype, w.rows, w.cols, base + lo * w.nbytes, (n_stack - lo) * w.nbytes, owner,
                              n_stack - lo)  # fmt: skip
    # the held experts lo.. in ggml's repacked layout where it has one, indexed from expert 0 as in the file
    stacks = {k: weights.repacked(h).stacked(n_stack, lo) for k, h in stacks.items()}
    log.debug("layer %d: %d experts multiplied as stacks", layer, len(experts))
    return ffn.ExpertStack(
        down=stacks[DOWN], gate=stacks.get(GATE), up=stacks.get(UP), gate_up=stacks.get(GATE_UP)
    )


def _multiplied_in_place(slabs: Iterable[dict[str, SlabTensor]]) -> list[np.ndarray]:
    """The bytes of the slab parts that native calls multiply where they lie (not as a repacked copy)."""
    return [s.data for parts in slabs for s in parts.values() if _in_place(s)]


def swiglu(w: ExpertWeights, x: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) for rows x [N, D] -> [N, D], in float32, with torch (exact on a GPU)."""
    h = F.linear(x, w.gate_up, w.gate_up_bias)  # [N, 2F]
    gate, up = h.chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down, w.down_bias)


def _fmt(ids: Sequence[int]) -> str:
    return format_ranges(ids) if ids else "none"


def slab_dims(key: SlabKey, parts: dict[str, SlabTensor]) -> tuple[int, int]:
    """(D, F) of one expert's slabs, checking that its parts are complete and agree."""
    layer, expert = key
    if DOWN not in parts or not (GATE_UP in parts or (GATE in parts and UP in parts)):
        raise ValueError(
            f"slab {layer}:{expert} is incomplete (has {sorted(parts)}); it needs "
            f"{GATE}, {UP} (or {GATE_UP}) and {DOWN}"
        )
    d, f = parts[DOWN].shape
    shapes = [parts[GATE_UP].shape] if GATE_UP in parts else [parts[GATE].shape, parts[UP].shape]
    want = [(2 * f, d)] if GATE_UP in parts else [(f, d), (f, d)]
    if [tuple(s) for s in shapes] != want:
        raise ValueError(
            f"slab {layer}:{expert}: gate/up shapes {shapes} do not match down {parts[DOWN].shape}"
        )
    return d, f


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
        slabs: Mapping[SlabKey, dict[str, SlabTensor]],
        device: str | torch.device = "cpu",
        memory_budget: int | None = None,
        stacked: bool = True,
    ) -> None:
        self.slabs = slabs
        self.stacked = stacked  # False: per-expert copies even where the GGUF stacks them (what audits use)
        self.device = torch.device(device)
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
        self._lock = threading.Lock()  # guards _cache, _bytes and the counters only
        self._load_locks = {key: threading.Lock() for key in slabs}
        self._cache: OrderedDict[SlabKey, ExpertWeights] = OrderedDict()
        self._native: dict[SlabKey, FFN | None] = {}  # views of the slab bytes, or repacked copies
        self._packed: OrderedDict[SlabKey, int] = OrderedDict()  # the repacked ones: bytes, LRU order
        self._packed_bytes = self._repacks = 0
        self._stacks: dict[int, ffn.ExpertStack | None] = {}  # per layer, where the GGUF stacks them
        self._stack_lock = threading.Lock()
        # the slab pages are mapped in while the process starts up, not one fault at a time in the first calls
        # (not those that native calls multiply as a repacked copy: they are read once, by `prepare`)
        if not lazy:
            pages.populate(_multiplied_in_place(slabs.values()))
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._dropped: frozenset[SlabKey] = frozenset()

    def add(self, key: SlabKey, parts: dict[str, SlabTensor]) -> None:
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
        pages.populate(_multiplied_in_place([parts]), background=False)  # the caller's thread: one slab

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
        self._native.pop(key, None)
        self._packed_bytes -= self._packed.pop(key, 0)
        w = self._cache.pop(key, None)
        if w is not None:
            self._bytes -= w.nbytes

    def dropped(self) -> list[SlabKey]:
        """The slabs `remove` took out of service (and `add` has not taken back)."""
        return sorted(self._dropped)

    def held(self) -> list[SlabKey]:
        return sorted(self.slabs)

    def lists(self, layer: int, expert: int) -> bool:
        """Whether this store holds the slab by its list (a lazily read slab file is not read to tell)."""
        return expert in self._experts_of.get(layer, ())

    def layers(self) -> list[int]:
        return sorted(self._experts_of)

    def cache_stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(
                self._hits, self._misses, self._evictions, self._bytes, len(self._cache),
                self._packed_bytes, len(self._packed), self._repacks,
            )  # fmt: skip

    def weights(self, layer: int, expert: int) -> ExpertWeights:
        """The working copy of one expert, dequantizing it if it is not resident."""
        key = (layer, expert)
        parts = self._parts(key)
        with self._lock:
            w = self._cache.get(key)
            if w is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return w
        with self._load_locks[key]:
            with self._lock:  # another call may have loaded it while this one waited
                w = self._cache.get(key)
                if w is not None:
                    self._cache.move_to_end(key)
                    self._hits += 1
                    return w
                self._misses += 1
            w = dequantize_expert(parts, self.device)
            with self._lock:
                if self.slabs.get(key) is parts:  # not removed (or replaced) while it was copied
                    self._cache[key] = w
                    self._bytes += w.nbytes
                    self._evict_over_budget(keep=key)
        return w

    def _parts(self, key: SlabKey) -> dict[str, SlabTensor]:
        """The slab's parts; MissingSlabs when it is not held (never held, or removed)."""
        parts = self.slabs.get(key)
        if parts is None:
            raise MissingSlabs(key[0], [key[1]], self.layers())
        return parts

    def _evict_over_budget(self, keep: SlabKey) -> None:
        """Drop the least recently used copies (float32 ones first: only exact calls use them) until what is
        kept fits the budget; never `keep`, the copy just made. Under self._lock."""
        if not self.memory_budget:
            return
        for cache in (self._cache, self._packed):
            for key in [k for k in cache if k != keep]:
                if self._bytes + self._packed_bytes <= self.memory_budget:
                    return
                if cache is self._cache:
                    self._bytes -= self._cache.pop(key).nbytes
                    self._evictions += 1
                else:
                    self._packed_bytes -= self._packed.pop(key)
                    self._native.pop(key, None)  # a call computing it holds its own reference
                log.debug("evicted the copy of expert %d of layer %d", key[1], key[0])

    def check(self, layer: int, expert_ids: Sequence[int], counts: Sequence[int], rows: torch.Tensor) -> None:
        """Raise BadCall or MissingSlabs when a call does not fit this store; do nothing otherwise."""
        if len(expert_ids) != len(counts):
            raise BadCall(
                f"{len(expert_ids)} expert ids but {len(counts)} counts; send one row count per expert id"
            )
        if any(c < 0 for c in counts):
            raise BadCall(f"negative row count in {list(counts)}")
        if rows.dim() != 2:
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
        f = self._native.get(key, _UNSET)
        if f is _UNSET:
            with self._load_locks[key]:  # two calls needing the same new expert repack it once
                f = self._native.get(key, _UNSET)
                if f is _UNSET:
                    parts = self._parts(key)
                    f = native_ffn(parts)
                    copied = sum(w.nbytes for w in f.matrices if w.repack is not None) if f else 0
                    with self._lock:
                        if self.slabs.get(key) is not parts:  # removed (or replaced) while it was copied
                            return f
                        self._native[key] = f
                        if copied:
                            self._packed[key] = copied
                            self._packed_bytes += copied
                            self._repacks += 1
                            self._evict_over_budget(keep=key)
        elif key in self._packed:
            with self._lock:
                if key in self._packed:
                    self._packed.move_to_end(key)
        return f  # type: ignore[return-value]

    def ready(self, layer: int, expert: int) -> bool:
        """Whether native calls of this expert find it as they multiply it (its repacked copy made and not
        evicted, or its bytes in place), with nothing to copy first."""
        return (layer, expert) in self._native

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
                    stack = self._stacks[layer] = _find_stack(layer, parts)  # type: ignore[arg-type]
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
                size = _copied_bytes(self.slabs[(layer, expert)])
                if (
                    self.memory_budget
                    and size
                    and self._bytes + self._packed_bytes + size > self.memory_budget
                ):
                    continue
                self.ffn(layer, expert, Numerics.NATIVE)
                made += 1
        if made < total:
            log.warning(
                "%d of %d experts fit the memory budget (%.1f GiB) as ggml's repacked copies; the others are "
                "copied when a call needs them (slower calls): give more memory (--memory) to keep them all",
                made, total, self.memory_budget / 2**30,
            )  # fmt: skip

    def compute(
        self,
        layer: int,
        expert_ids: Sequence[int],
        counts: Sequence[int],
        rows: torch.Tensor,
        numerics: Numerics = Numerics.NATIVE,
    ) -> torch.Tensor:
        """Rows packed expert-major (counts[i] rows for expert_ids[i]) -> outputs [N, D] float32 in the same order."""
        self.check(layer, expert_ids, counts, rows)
        if numerics not in tuple(Numerics):
            raise BadCall(f"unknown numerics {numerics!r}; use one of {', '.join(tuple(Numerics))}")
        if numerics == Numerics.EXACT and self.device.type != "cpu":
            return self._compute_torch(layer, expert_ids, counts, rows)
        x = rows.to("cpu", torch.float32).contiguous()
        out = torch.empty_like(x)
        stack = self.stack(layer) if numerics == Numerics.NATIVE else None
        if stack is not None:
            ids = torch.repeat_interleave(torch.tensor(expert_ids), torch.tensor(counts))
            ffn.moe_rows(stack, ids[:, None], x, out)
            return out
        blocks, start = [], 0
        for expert, n in zip(expert_ids, counts, strict=True):
            if n:
                blocks.append((self.ffn(layer, expert, numerics), start, n))
            start += n
        ffn.ffn_rows(blocks, x, out)
        return out

    def held_stack(self, layer: int, ids: torch.Tensor) -> ffn.ExpertStack | None:
        """This layer's experts as one stack (None when they do not lie stacked), after checking that every
        expert of ids is held here."""
        stack = self.stack(layer)
        if stack is not None:
            self._check_held(layer, ids.reshape(-1).tolist())
        return stack

    def compute_slots(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """Native numerics, in process: every token's K experts, x [T, D], ids [T, K] -> [T, K, D], with no
        packing when this layer's experts lie stacked (else None: use `compute`). The same bits as `compute`
        of the same pairs, on a node or here."""
        stack = self.held_stack(layer, ids) if x.device.type == "cpu" else None
        if stack is None:
            return None
        x = x.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], ids.shape[1], x.shape[1], dtype=torch.float32)
        ffn.moe_rows(stack, ids, x, out)
        return out

    def _compute_torch(
        self, layer: int, expert_ids: Sequence[int], counts: Sequence[int], rows: torch.Tensor
    ) -> torch.Tensor:
        x = rows.to(self.device, torch.float32)
        out = torch.empty_like(x)
        start = 0
        for expert, n in zip(expert_ids, counts, strict=True):
            if n:
                out[start : start + n] = swiglu(self.weights(layer, expert), x[start : start + n])
            start += n
        return out
