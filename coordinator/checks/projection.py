"""Every answer checked at the cost of dot products: random projections (Freivalds) of the products an
expert makes, against vectors this coordinator keeps in place of the experts' weights.

For a matrix W and a secret random vector r, rᵀ(W·x) = (Wᵀr)·x. Per expert, with r1, r2 (length F) and r3
(length D) drawn once per coordinator from the operating system's randomness and never sent anywhere:
- v_gu = gateᵀr1 + upᵀr2 (length D) checks a row's gate and up products g, u (the node sends them beside its
  answer) against the row x: r1·g + r2·u = v_gu·x̂;
- h = silu(g) ⊙ u is formed here by ggml's own swiglu (the bits the node's graph formed), and
  v_d = downᵀr3 (length F) checks the answer y against it: r3·y = v_d·ĥ.
x̂ and ĥ are the values the node's kernels multiplied: the rows quantized exactly as its kernel for the
matrix's type quantizes them (Q8_K blocks for the K-quants, Q8_0, F16 / BF16 rounding, none for F32;
swarm.compute.rowquant.kernel_values). Gate and up are checked against x on their own, so a wrong g or u
cannot pass by a y made consistent with it: y is checked against the h of the g and u that passed.

The residual of an honest answer is float32 rounding only: the node's sums in another order than the exact
sum of the same products (the integer sums inside a quantized block are exact). For a row the node's error δ
in its products is at most γ·Σⱼ|Wᵢⱼ||x̂ⱼ| per element, so ‖δ‖ ≤ γ·‖W‖_F·‖x̂‖, and since r is Gaussian and
independent of δ, r·δ is a normal variable of deviation ‖δ‖. The tolerance is τ = SIGMAS·c·u·‖W‖_F·‖x̂‖ (u =
2⁻²⁴, c the kernel class's error constant measured in docs/BENCHMARKS.md, SIGMAS standard deviations: an
honest answer exceeds it with probability ~1e-15 per check), plus the rounding of the float32 vectors kept
here. A change Δ of the products is missed only when |r·Δ| ≤ τ: with probability ≤ √(2/π)·τ/‖Δ‖ for each of
the PROJECTIONS independent r (bench/trust.py reports τ as a fraction of the rows' norms).

A node of another numerics class (AVX-512, ARM's NEON generations) sums in another order, which the bound
covers as it stands (it holds for any order), and rounds with its own code: its quantizer may round an element
of x lying within an ulp of a step the other way (ARM's Q8_0 code scales by 1/(amax/127), x86's by
127/amax; ARM's compiler fuses Q8_K's rounding into the product: about 1.3 elements in a million), and its
own silu may put an element of h on the other side of one. For such a node each element of x̂ and ĥ within
REACH of a step may take either, and the tolerance allows that step; it widens τ on the 1-2 % of rows that
have such an element (bench/bound_builds.py measures honest answers of those builds, docs/BENCHMARKS.md).

An answer that fails is not a verdict: it is recomputed exactly (swarm.coordinator.checks.audit) before a
node is banned. Nothing here is sent to a node.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from swarm.compute.ffn import swiglu_rows
from swarm.compute.ggml import one_thread
from swarm.compute.priority import idle_priority
from swarm.compute.rowquant import kernel_offsets, kernel_steps, kernel_values, vec_dot_type
from swarm.compute.store import ExpertStore
from swarm.compute.values import ggml_values
from swarm.sharding.slabs import SlabKey, SlabTensor

log = logging.getLogger(__name__)

U = 2.0**-24  # float32's unit roundoff
_CHECKABLE = frozenset((0, 1, 30, 8, 15))  # row types kernel_values reproduces: F32, F16, BF16, Q8_0, Q8_K
PROJECTIONS = 1  # independent r per matrix: the vectors' memory grows with it, a miss's probability falls as its power
SIGMAS = 8.0  # standard deviations of honest noise the tolerance leaves room for
# c per activation kind: the largest |r·δ| / (u·‖W‖_F·‖x̂‖) measured over honest answers of every fixture type
# (tests/test_projection.py, docs/BENCHMARKS.md), rounded up; float rows sum every product in float32.
ERROR_CONSTANT = 1.0
KEPT = 4.0  # ulps of error in each element of a kept vector (a float32 product of F or D terms, rounded)
# A node of another numerics class quantizes x and h with its own code (ARM's Q8_0 scales by 1/(amax/127),
# x86's by 127/amax; ARM fuses Q8_K's rounding into the product), which finds where an element lies between
# two steps with a few float32 roundings of its own, and forms h with its own silu: an element of x or h
# within REACH of itself from a rounding boundary of the kernel's row type (16 ulps) may take the other step
# there, and the check allows that step (the check alone; the exact one is checks/tolerance.py).
REACH = 2.0**-20
BATCH_ROWS = 2048  # rows checked in one computation (its float64 temporaries: tens of MB at a real model's width)
BIG_CALL = 64  # rows of a call checked on its own (a prompt's), not copied in with others (decode steps')


@dataclass(frozen=True)
class ExpertVectors:
    """What this coordinator keeps of one expert to check its answers: vectors, not weights."""

    gate_up: tuple[tuple[int, np.ndarray], ...]  # (weight type x̂ is made for, [P, D] float32) per term
    down: np.ndarray  # [P, F] float32: downᵀr3
    down_type: int
    gate_up_norm: float  # √(‖gate‖_F² + ‖up‖_F²), over the dequantized values
    down_norm: float
    gate_up_bias: np.ndarray  # [P] r·bias of the products (0 without biases)
    down_bias: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for _, v in self.gate_up) + self.down.nbytes


@dataclass(frozen=True)
class Answered:
    """One call's answer to check: the rows sent [N, D], the answer [N, D] and inner products [N, 2F]
    (float32), and how the node computed it (see Projections.check)."""

    layer: int
    expert_ids: list[int]
    counts: list[int]
    rows: np.ndarray
    answer: np.ndarray
    inner: np.ndarray
    native: bool = True
    answer_unit: float = 0.0
    other_class: bool = False


@dataclass(frozen=True)
class Failed:
    """Rows of a call whose check failed, and by how much (residual / tolerance, the largest)."""

    rows: list[int]
    worst: float
    what: str  # "gate/up" or "down" (the first that failed)


class Projections:
    """The secret vectors r of this coordinator, each expert's checking vectors (made on first use, or all at
    once by `prepare`), and the check of a call's answer."""

    def __init__(self, store: ExpertStore, projections: int = PROJECTIONS, seed: int | None = None) -> None:
        self.store = store
        self.projections = projections
        # a node must not be able to guess r: the operating system's randomness unless a test fixes a seed
        self._rng = np.random.default_rng(secrets.randbits(128) if seed is None else seed)
        self._r: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (D, F) -> (r_gu, r_d)
        self._vectors: dict[SlabKey, ExpertVectors] = {}
        self._locks: dict[SlabKey, threading.Lock] = {}
        self._checkable: dict[SlabKey, bool] = {}  # whether a held expert's types can be checked (checkable)
        self._lock = threading.Lock()
        self._stop = threading.Event()  # close(): `prepare` ends
        self.checks = 0
        self.failures = 0

    def secret(self, d: int, f: int) -> tuple[np.ndarray, np.ndarray]:
        """(r1 | r2 as [P, 2F], r3 as [P, D]) float64, standard normal, drawn once per width."""
        with self._lock:
            r = self._r.get((d, f))
            if r is None:
                r = self._r[(d, f)] = (
                    self._rng.standard_normal((self.projections, 2 * f)),
                    self._rng.standard_normal((self.projections, d)),
                )
            return r

    @property
    def nbytes(self) -> int:
        """Bytes of checking vectors resident."""
        return sum(v.nbytes for v in list(self._vectors.values()))

    def vectors(self, layer: int, expert: int) -> ExpertVectors:
        key = (layer, expert)
        v = self._vectors.get(key)
        if v is not None:
            return v
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # made once, whichever thread needs it first
            v = self._vectors.get(key)
            if v is None:
                v = self._vectors[key] = self._make(key)
        return v

    def checkable(self, layer: int, expert_ids: list[int]) -> bool:
        """Whether these experts' slabs are here and every matrix's kernel multiplies rows a projection can
        reproduce (not one pairing with Q8_1)."""
        for e in expert_ids:
            known = self._checkable.get((layer, e))
            if known is None:
                slab = self.store.slabs.get((layer, e)) if self.store.holds(layer, e) else None
                known = slab is not None and all(
                    part is None or vec_dot_type(int(part.qtype)) in _CHECKABLE
                    for part in (slab.gate, slab.up, slab.gate_up, slab.down)
                )
                if slab is not None:  # (a slab not held here may come later; one held keeps its types)
                    self._checkable[(layer, e)] = known
            if not known:
                return False
        return True

    def prepare(self) -> None:
        """Every expert's vectors now, each slab read once (a coordinator's start; `begin` runs it aside)."""
        for layer, expert in self.store.held():
            if self._stop.is_set():
                return
            self.vectors(layer, expert)

    def begin(self) -> None:
        """`prepare` on a thread of its own at the idle priority, from a coordinator's start: the first prompt
        finds most vectors made (one it needs first is made on its thread, once)."""
        def run() -> None:
            idle_priority()
            self.prepare()

        threading.Thread(target=run, name="swarm-projections", daemon=True).start()

    @classmethod
    def started(cls, store: ExpertStore, seed: int | None = None) -> Projections:
        """Projections of this coordinator's own slabs (r from `seed` only where a test fixes one), begun."""
        p = cls(store, seed=seed)
        p.begin()
        return p

    def close(self) -> None:
        self._stop.set()

    def _make(self, key: SlabKey) -> ExpertVectors:
        slab = self.store.slabs[key]
        assert slab.down is not None
        d, f = slab.down.shape
        r_gu, r_d = self.secret(d, f)
        parts: list[tuple[SlabTensor, np.ndarray, SlabTensor | None]] = []
        if slab.gate_up is not None:
            parts.append((slab.gate_up, r_gu, slab.gate_up_bias))
        else:
            assert slab.gate is not None and slab.up is not None
            parts += [(slab.gate, r_gu[:, :f], slab.gate_bias), (slab.up, r_gu[:, f:], slab.up_bias)]
        terms: dict[int, np.ndarray] = {}  # x̂ kind -> Σ of Wᵀr over the matrices that take that x̂
        square = 0.0
        bias = np.zeros(self.projections)
        for part, r, b in parts:
            v, sq = _project(part, r)
            kind = vec_dot_type(int(part.qtype))
            terms[kind] = terms.get(kind, 0) + v
            square += sq
            if b is not None:
                bias += r @ _values(b).reshape(-1).astype(np.float64)
        by_type = tuple((_weight_of(parts, kind), v.astype(np.float32)) for kind, v in terms.items())
        v_d, sq_d = _project(slab.down, r_d)
        down_bias = r_d @ _values(slab.down_bias).reshape(-1) if slab.down_bias is not None else np.zeros(self.projections)
        return ExpertVectors(
            by_type, v_d.astype(np.float32), int(slab.down.qtype), float(np.sqrt(square)), float(np.sqrt(sq_d)),
            bias, np.asarray(down_bias, np.float64),
        )  # fmt: skip

    def check(
        self, layer: int, expert_ids: list[int], counts: list[int], rows: np.ndarray, answer: np.ndarray,
        inner: np.ndarray, native: bool = True, answer_unit: float = 0.0, other_class: bool = False,
    ) -> Failed | None:  # fmt: skip
        """None when every row of a call's answer [N, D] and inner products [N, 2F] passes against the rows
        sent [N, D] (float32 values as the node took them); else the rows that failed. `native`: the node
        multiplied in the weights' types (x̂ quantized as its kernels do) rather than float32 (exact);
        `answer_unit`: the unit roundoff of the answer's wire type (F16 / BF16 answers are rounded: the
        check then sees only changes larger than that rounding), 0 for float32; `other_class`: the node's
        numerics class is not this coordinator's (see REACH)."""
        call = Answered(layer, expert_ids, counts, rows, answer, inner, native, answer_unit, other_class)
        return self.check_many([call])[0]

    def check_many(self, calls: Sequence[Answered]) -> list[Failed | None]:
        """`check` of several calls at once (a pass's answers, every layer's): their rows in one computation
        per kind of expert (the same types and check), so a pass costs a few dozen array operations, not a
        few dozen for each of its calls."""
        results: list[Failed | None] = [None] * len(calls)
        ratios = [(np.zeros(int(c.rows.shape[0])), np.zeros(int(c.rows.shape[0]))) for c in calls]
        # (call, its first row, rows, the expert's vectors) by kind: the experts' types, the check's settings
        groups: dict[tuple[Any, ...], list[tuple[int, int, int, ExpertVectors]]] = {}
        for i, c in enumerate(calls):
            n = int(c.rows.shape[0])
            if c.answer.shape != c.rows.shape or c.inner.ndim != 2 or c.inner.shape[0] != n or sum(c.counts) != n:
                results[i] = Failed(list(range(n)), float("inf"), "shape")
                continue
            blocks, at = [], 0
            for expert, count in zip(c.expert_ids, c.counts, strict=True):
                if count:
                    blocks.append((i, at, count, self.vectors(c.layer, expert)))
                at += count
            if any(c.inner.shape[1] != 2 * v.down.shape[1] for _, _, _, v in blocks):
                results[i] = Failed(list(range(n)), float("inf"), "shape")
                continue
            for b in blocks:
                v = b[3]
                kind = (tuple(t for t, _ in v.gate_up), v.down_type, v.down.shape[1], c.native, c.answer_unit,
                        c.other_class, int(c.rows.shape[1]))  # fmt: skip
                groups.setdefault(kind, []).append(b)
        # (the check's settings, members) with at most BATCH_ROWS rows (bounded temporaries); a call of
        # BIG_CALL rows or more (a prompt's) in a chunk of its own, whose rows are then taken without a copy
        chunks = []
        big = [int(c.rows.shape[0]) >= BIG_CALL for c in calls]
        for kind, members in groups.items():
            chunk: list[tuple[int, int, int, ExpertVectors]] = []
            size = 0
            for m in members:
                if chunk and (size + m[2] > BATCH_ROWS or (m[0] != chunk[-1][0] and (big[m[0]] or big[chunk[-1][0]]))):
                    chunks.append((kind, chunk))
                    chunk, size = [], 0
                chunk.append(m)
                size += m[2]
            chunks.append((kind, chunk))
        for (_, _, _, native, unit, other, _), members in chunks:
            def gather(name: str, members: list[tuple[int, int, int, ExpertVectors]] = members) -> np.ndarray:
                first, start = members[0][0], members[0][1]
                if all(i == first for i, _, _, _ in members) and all(
                    a == b[1] + b[2] for (_, a, _, _), b in zip(members[1:], members, strict=False)
                ):  # one run of one call's rows (a prompt's call): no copy
                    return getattr(calls[first], name)[start : members[-1][1] + members[-1][2]]
                return np.concatenate([getattr(calls[i], name)[a : a + n] for i, a, n, _ in members])

            gu, d = self._group(gather("rows"), gather("answer"), gather("inner"),
                                [(0, n, v) for _, _, n, v in members], native, unit, other)  # fmt: skip
            at = 0
            for i, a, n, _ in members:
                ratios[i][0][a : a + n], ratios[i][1][a : a + n] = gu[at : at + n], d[at : at + n]
                at += n
        every = [np.concatenate([r[k] for r in ratios]) for k in (0, 1)] if ratios else [np.zeros(0)] * 2
        held = bool(((every[0] <= 1.0) & (every[1] <= 1.0)).all())  # (NaN fails too)
        for i, (ratio_gu, ratio_d) in enumerate(ratios):
            if results[i] is not None or held:
                continue
            bad = [int(j) for j in np.flatnonzero(~((ratio_gu <= 1.0) & (ratio_d <= 1.0)))]
            if bad:
                what = "gate/up" if not ratio_gu[bad[0]] <= 1.0 else "down"
                worst = float(np.nanmax(np.concatenate([ratio_gu[bad], ratio_d[bad]])))
                results[i] = Failed(bad, worst, what)
        with self._lock:
            self.checks += len(calls)
            self.failures += sum(r is not None for r in results)
        return results

    def _group(
        self, rows: np.ndarray, answer: np.ndarray, inner: np.ndarray, members: list[tuple[int, int, ExpertVectors]],
        native: bool, answer_unit: float, other_class: bool,
    ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """(gate/up, down) residual / tolerance per row, for the rows of experts stored in the same types."""
        counts = [c for _, c, _ in members]
        vs = [v for _, _, v in members]

        def per_row(arrays: list[np.ndarray]) -> np.ndarray:
            return np.repeat(np.stack(arrays), counts, axis=0)

        def each(arrays: list[np.ndarray]) -> np.ndarray:  # [E, P, d] float64, an expert's vectors each
            return np.stack(arrays).astype(np.float64)

        r_gu, r_d = self.secret(int(rows.shape[1]), int(vs[0].down.shape[1]))
        reach = other_class and native
        types = [t for t, _ in vs[0].gate_up]
        terms = [(_act(rows, t, native), each([v.gate_up[k][1] for v in vs])) for k, t in enumerate(types)]
        # another build's quantizer may round an element of x next to a step the other way (see REACH)
        x_steps = [_near_steps(rows, t) for t in types] if reach else None
        ratio_gu = _ratio(inner, r_gu, per_row([v.gate_up_bias for v in vs]), terms, per_row([v.gate_up_norm for v in vs]),
                          steps=x_steps, counts=counts)  # fmt: skip
        with one_thread():  # a few microseconds of work: a team of threads would only wait for each other
            h = swiglu_rows(np.ascontiguousarray(inner, np.float32))
        h_act = _act(h, vs[0].down_type, native)
        h_steps = [_near_steps(h, vs[0].down_type)] if reach else None
        ratio_d = _ratio(answer, r_d, per_row([v.down_bias for v in vs]), [(h_act, each([v.down for v in vs]))],
                         per_row([v.down_norm for v in vs]), answer_unit, h_steps, counts)  # fmt: skip
        return ratio_gu, ratio_d


def unit_roundoff(dtype: object) -> float:
    """The unit roundoff of an answer's float type (torch or numpy): 0 for float32, which loses nothing."""
    name = str(dtype).rsplit(".", 1)[-1]
    return {"float16": 2.0**-11, "bfloat16": 2.0**-8}.get(name, 0.0)


def _act(x: np.ndarray, weight_type: int, native: bool) -> np.ndarray:
    """The values a kernel multiplies for rows x (float64)."""
    x = np.ascontiguousarray(x, np.float32)
    if not native:
        return x.astype(np.float64)
    made = kernel_values(x, weight_type)
    if made is None:
        raise ValueError(f"ggml type {weight_type}'s kernel adds terms a projection cannot check")
    return made


def _ratio(
    products: np.ndarray, r: np.ndarray, bias: np.ndarray, terms: list[tuple[np.ndarray, np.ndarray]],
    norm: float | np.ndarray, rounded: float = 0.0, steps: list[np.ndarray] | None = None,
    counts: Sequence[int] | None = None,
) -> np.ndarray:  # fmt: skip
    """Per row, the largest over the projections of |r·products - Σ v·x̂ - r·bias| / its tolerance; the
    vectors v [P, d] (one expert's), [n, P, d] (each row's expert's), or with `counts` [E, P, d] (expert e's
    for counts[e] rows in turn), the norms and biases one or per row; `rounded`: the unit roundoff the
    products were rounded to after they were computed (r·that rounding is normal with a deviation of at most
    rounded·‖products‖); `steps` (one [n, cols] a term): the rounding steps another build may take, each
    allowed for in full (|v|·step)."""
    # (einsum, not BLAS: these products are small, and BLAS's threads stall on a busy machine's cores)
    n = int(products.shape[0])
    if counts is None and all(v.ndim == 2 for _, v in terms):  # one expert's for every row
        counts, terms = [n], [(x, v[None].astype(np.float64)) for x, v in terms]
    elif counts is None:  # each row's own: n runs of one
        counts = [1] * n
        terms = [(x, np.broadcast_to(v, (n, *v.shape[-2:])).astype(np.float64)) for x, v in terms]
    else:
        terms = [(x, v.astype(np.float64, copy=False)) for x, v in terms]
    norm = np.broadcast_to(np.asarray(norm, np.float64), (n,))
    said = np.einsum("nf,pf->np", products, r, dtype=np.float64)  # (float32 products taken as float64)
    expected = sum(_dots(x, v, counts) for x, v in terms) + bias
    sizes = [np.sqrt(np.einsum("ij,ij->i", x, x)) for x, _ in terms]  # ‖x̂‖ per row, each term's
    size = np.sqrt(sum(z * z for z in sizes))
    # the vectors' own float32 error (their product and their rounding): |Σ (v - fl(v))·x̂| ≤ KEPT·u·Σ|v||x̂|
    # ≤ KEPT·u·‖v‖·‖x̂‖ (Cauchy-Schwarz: no pass over the rows of its own, a bound about 1.5x the sum's)
    kept = sum(np.repeat(np.sqrt(np.einsum("epd,epd->ep", v, v)), counts, axis=0) * z[:, None]
               for (_, v), z in zip(terms, sizes, strict=True)) * KEPT * U  # fmt: skip
    tol = SIGMAS * ERROR_CONSTANT * U * norm[:, None] * size[:, None] + kept + np.finfo(np.float32).tiny
    if rounded:
        tol = tol + SIGMAS * rounded * np.linalg.norm(products.astype(np.float64), axis=1)[:, None]
    if steps is not None:
        tol = tol + sum(_dots(s, np.abs(v), counts) for s, (_, v) in zip(steps, terms, strict=True))
    with np.errstate(invalid="ignore", over="ignore"):
        out = np.abs(said - expected) / tol
    return np.where(np.isfinite(out), out, np.inf).max(axis=1)


def _dots(x: np.ndarray, v: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """[n, P]: each row of x [n, d] times its expert's vectors, v [E, P, d] holding expert e's for the next
    counts[e] rows. A prompt's rows come in long runs of one expert: one product a run; a decode pass's in
    runs of one or two: the vectors repeated to the rows, one product for all."""
    if len(counts) == 1:
        return np.einsum("nd,pd->np", x, v[0])
    if len(counts) == int(x.shape[0]):  # a run of one each
        return np.einsum("nd,npd->np", x, v)
    if len(counts) * 4 > int(x.shape[0]):
        return np.einsum("nd,npd->np", x, np.repeat(v, counts, axis=0))
    out = np.empty((int(x.shape[0]), int(v.shape[1])))
    at = 0
    for e, c in enumerate(counts):
        out[at : at + c] = np.einsum("nd,pd->np", x[at : at + c], v[e])
        at += c
    return out


def _near_steps(h: np.ndarray, weight_type: int) -> np.ndarray:
    """[n, cols] the step of each element of rows h that lies within REACH of itself from a rounding boundary
    of the kernel for weight_type (another build may round it the other way), 0 elsewhere."""
    steps = kernel_steps(h, weight_type)
    offset, unit = kernel_offsets(h, weight_type)
    reach = REACH * np.abs(h.astype(np.float64)) / np.where(unit > 0, unit, 1.0)
    near = (unit > 0) & (np.abs(0.5 - offset) <= reach)
    return np.where(near, steps, 0.0)


def _values(part: SlabTensor) -> np.ndarray:
    """A slab part's float32 values (ggml's own dequantizer where it has one)."""
    return ggml_values(part.data, int(part.qtype), tuple(part.shape))


def _project(part: SlabTensor, r: np.ndarray) -> tuple[np.ndarray, float]:
    """(Wᵀr [P, cols] float64, ‖W‖_F²) of one matrix, from its dequantized values: a float32 product (its
    rounding, a few u of each element, is in the tolerance's KEPT term)."""
    w = _values(part).reshape(part.shape[0], -1)
    flat = w.reshape(-1)
    v = np.einsum("pi,ij->pj", r.astype(np.float32), w).astype(np.float64)
    return v, float(np.einsum("i,i->", flat, flat))


def _weight_of(parts: list[tuple[SlabTensor, np.ndarray, SlabTensor | None]], kind: int) -> int:
    """A weight type among parts whose kernels quantize rows to `kind`."""
    return next(int(p.qtype) for p, _, _ in parts if vec_dot_type(int(p.qtype)) == kind)
