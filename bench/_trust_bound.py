"""bench/trust.py's bound and footprint of the projection checks (swarm.coordinator.checks.projection).

bound: honest answers of this build's kernels (every weight type of the fixtures, native and exact numerics,
and the 35B layer shape of the bench model), rows of several scales with outlier columns: the largest ‖δ‖ / (u
·‖W‖_F·‖x̂‖) seen (δ: the node's products against the exact sum of the kernel's own values, the constant c the
tolerance takes as ERROR_CONSTANT), the largest honest residual as a share of the tolerance, the tolerance as a
fraction of the row's norm, and the probability that one random r misses a change of 1e-4 and 1e-3 of it.

footprint: the vectors' bytes per expert and for the real shapes; the bytes an answer carries on the wire.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from swarm.compute.ffn import swiglu_rows
from swarm.compute.slabs import load_slabs
from swarm.compute.store import ExpertStore
from swarm.coordinator.checks import projection as P
from swarm.proto.numerics import Numerics

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
FILES = [
    "qwen35moe-tiny/model-f32.gguf",
    "qwen35moe-tiny/model-bf16.gguf",
    "qwen35moe-quant/model-q8_0.gguf",
    "qwen35moe-quant/model-q4_k_m.gguf",
    "qwen3next-tiny/model-f32.gguf",
]
# (name, layers, experts a layer, D, F): the real models the vectors are for
SHAPES = [("Qwen3.5/3.6-35B-A3B", 40, 256, 2048, 512), ("Qwen3.5-122B-A10B", 48, 256, 3072, 1024)]


def _rows(rng: np.random.Generator, n: int, d: int, trial: int) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32) * np.float32([0.01, 1.0, 30.0][trial % 3])
    if trial % 2:
        x[:, rng.integers(0, d, 3)] *= 50
    return x


def _measure(path: Path, numerics: Numerics, experts: int, trials: int) -> dict[str, float]:
    """Over honest calls: c (largest), the largest residual / tolerance, tolerance / row norm (largest)."""
    store = ExpertStore(load_slabs(path, verify=False).slabs, "cpu", stacked=False)
    checks = P.Projections(store, projections=1)
    rng = np.random.default_rng(0)
    native = numerics is Numerics.NATIVE
    c = ratio = rel = 0.0
    for layer in store.layers():
        for expert in sorted(e for n, e in store.held() if n == layer)[:experts]:
            slab = store.slabs[(layer, expert)]
            v = checks.vectors(layer, expert)
            r_gu, r_d = checks.secret(store.hidden_size, v.down.shape[1])
            for trial in range(trials):
                x = _rows(rng, 4, store.hidden_size, trial)
                y, inner = store.compute_inner(layer, [expert], [4], x, numerics)
                f = inner.shape[1] // 2
                h = swiglu_rows(inner)
                for w, got, rows in ((slab.gate, inner[:, :f], x), (slab.up, inner[:, f:], x), (slab.down, y, h)):
                    assert w is not None
                    xq = P._act(rows, int(w.qtype), native)
                    wv = P._values(w).astype(np.float64)
                    delta = np.linalg.norm(got - xq @ wv.T, axis=1)
                    scale = P.U * np.linalg.norm(wv) * np.linalg.norm(xq, axis=1)
                    c = max(c, float((delta / scale).max()))
                    # with the kept vectors' term KEPT·u·‖v‖·‖x̂‖, ‖v‖ taken as ‖W‖_F (E‖Wᵀr‖² = ‖W‖_F²)
                    tol = (P.SIGMAS * P.ERROR_CONSTANT + P.KEPT) * scale
                    rel = max(rel, float((tol / np.linalg.norm(got, axis=1)).max()))
                xs = [(P._act(x, t, native), vec) for t, vec in v.gate_up]
                a = P._ratio(inner, r_gu, v.gate_up_bias, xs, v.gate_up_norm)
                b = P._ratio(y, r_d, v.down_bias, [(P._act(h, v.down_type, native), v.down)], v.down_norm)
                ratio = max(ratio, float(a.max()), float(b.max()))
    return {"c": c, "ratio": ratio, "rel": rel}


def miss(tol_over_norm: float, change: float) -> float:
    """The probability that one Gaussian r misses a change of `change` x the row's norm: P(|N(0,1)| ≤ τ/‖Δ‖)."""
    return math.erf(tol_over_norm / change / math.sqrt(2))


def bound(bench_gguf: Path | None, experts: int = 4, trials: int = 6) -> str:
    lines = [
        "| file | numerics | c = max ‖δ‖/(u‖W‖_F‖x̂‖) | honest residual / tolerance (max) | tolerance / row norm (max) "
        "| P(miss 1e-4) | P(miss 1e-3) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    cases = [(FIXTURES / f, n, experts, trials) for f in FILES for n in (Numerics.NATIVE, Numerics.EXACT)]
    if bench_gguf is not None:
        cases.append((bench_gguf, Numerics.NATIVE, 2, 3))
    for path, numerics, ex, tr in cases:
        m = _measure(path, numerics, ex, tr)
        name = f"35B layer shape ({path.name})" if "q4k-q80" in path.name else f"{path.parent.name}/{path.name}"
        lines.append(
            f"| {name} | {numerics.value} | {m['c']:.3f} | {m['ratio']:.3f} | {m['rel']:.2e} | "
            f"{miss(m['rel'], 1e-4):.3f} | {miss(m['rel'], 1e-3):.4f} |"
        )
    lines.append(
        f"\nTolerance: τ = {P.SIGMAS:g} x {P.ERROR_CONSTANT:g} x u x ‖W‖_F x ‖x̂‖ + {P.KEPT:g} x u x ‖v‖ x ‖x̂‖ (the "
        "kept vectors' own error, v = Wᵀr; ‖v‖ taken as ‖W‖_F in the fraction of the row's norm), "
        f"{P.PROJECTIONS} projection(s) a matrix; a change Δ is missed with probability erf(τ/(‖Δ‖√2)) ≤ "
        "√(2/π)·τ/‖Δ‖ per projection (independent projections multiply)."
    )
    return "\n".join(lines)


def footprint(measured: dict[str, float]) -> str:
    lines = ["| shape | experts | vectors a projection | per expert |", "|---|---:|---:|---:|"]
    for name, layers, experts, d, f in SHAPES:
        per = (d + f) * 4
        total = layers * experts * per
        lines.append(f"| {name} ({layers} layers, D {d}, F {f}) | {layers * experts:,} | {total / 2**20:.0f} MiB | {per:,} B |")
    lines.append("")
    lines += [f"- {k}: {v:,.2f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in measured.items()]
    return "\n".join(lines)
