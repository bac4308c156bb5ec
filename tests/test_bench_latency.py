"""bench/latency.py's arithmetic: the bound beside each figure, the tokens a pass yields at an accept rate, the
40-layer projection, the goals it reports met or not, and the nodes' expert quarters."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def report() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))
    try:
        import _latency_report

        yield _latency_report
    finally:
        sys.path.remove(str(BENCH))


def _run(
    report: ModuleType, pass_ms: float, per_pass: int, n: int = 33, accepted: int | None = None
) -> object:
    """A made-up run of n tokens whose passes took pass_ms and yielded per_pass tokens each."""
    from _latency_swarm import Run

    passes = (n - 1) // per_pass
    decode_s = passes * pass_ms / 1e3
    kept = (n - 1) - passes if accepted is None else accepted
    return Run(
        tps=(n - 1) / decode_s,
        tokens=list(range(n)),
        decode_s=decode_s,
        passes=passes,
        accepted=kept,
        drafted=kept,
        windows=passes if per_pass > 1 else 0,
        wait_s=passes * 0.01,
        node_busy_s=[passes * 0.005] * 4,
    )


def test_tokens_per_pass_at_an_accept_rate(report: ModuleType) -> None:
    assert report.expected_tokens(0.82, 2) == pytest.approx(1 + 0.82 + 0.82**2)
    assert report.expected_tokens(1.0, 3) == pytest.approx(4.0)  # known-right: k + 1
    assert report.expected_tokens(0.0, 3) == pytest.approx(1.0)  # every draft wrong: the pass's own token
    assert report.expected_tokens(0.5, 0) == pytest.approx(1.0)


def test_the_bound_and_the_projection(report: ModuleType) -> None:
    # 4 layers x 5 ms + 60 ms of compute: 80 ms a token
    assert report.bound_tps(1.0, 4, 0.005, 0.060) == pytest.approx(12.5)
    assert report.bound_tps(4.0, 4, 0.005, 0.180) == pytest.approx(20.0)
    # 40 layers x (5 ms + 60 ms / 4 layers): 800 ms
    assert report.projected_pass_s(0.080, 0.005, 4) == pytest.approx(0.8)
    assert report.projected_pass_s(0.060, 0.0, 4, to_layers=8) == pytest.approx(0.12)


def test_goals_follow_the_figures(report: ModuleType) -> None:
    f = report.Figures(layers=4, n_prompt=64, n_decode=33, reps=1, threads=1, audit=0.0,
                       rtts=[0.0, 2.0, 5.0], ping_ms={0.0: 0.1, 2.0: 2.1, 5.0: 5.1})  # fmt: skip
    f.runs = {
        ("none", 0.0): [_run(report, 60, 1)],
        ("none", 2.0): [_run(report, 68, 1)],  # exactly the bound: 8 ms of round trips + 60
        ("none", 5.0): [_run(report, 120, 1)],  # 80 ms is the bound: 0.67x
        ("known3", 0.0): [_run(report, 100, 4)],
        ("known3", 5.0): [_run(report, 120, 4)],  # 4 tokens in the no-draft run's time of one: 4x
    }
    assert f.bound("none", 5.0) == pytest.approx(12.5)
    assert f.med("none", 2.0) / f.bound("none", 2.0) == pytest.approx(1.0)
    assert f.bound("known3", 5.0) == pytest.approx(4 / 0.120)
    measured, bound = f.projected("none", 5.0)
    assert measured == pytest.approx(1 / (40 * 0.120 / 4))
    assert bound == pytest.approx(1 / (40 * (0.005 + 0.015)))
    said = "\n".join(report.goals(f))
    assert "No drafts at 2 ms: 1.00x the bound (goal >= 0.8x): **met**" in said
    assert "No drafts at 5 ms: 0.67x the bound (goal >= 0.8x): **NOT met**" in said
    assert "3 known-right drafts at 5 ms: 4.00x the no-draft figure" in said
    assert "**NOT met**" not in said.split("\n")[2]

    f.runs[("known3", 5.0)] = [_run(report, 240, 4)]  # a window costing 2x the one-token pass: 2x
    assert "2.00x the no-draft figure" in report.goals(f)[2] and "**NOT met**" in report.goals(f)[2]


def test_the_section_renders_every_row(report: ModuleType) -> None:
    f = report.Figures(layers=4, n_prompt=64, n_decode=33, reps=1, threads=1, audit=0.0,
                       rtts=[0.0, 5.0], ping_ms={0.0: 0.1, 5.0: 5.1}, loads=[1.0, 2.0])  # fmt: skip
    f.runs = {("none", None): [_run(report, 62, 1)]}
    for rtt, extra in ((0.0, 0), (5.0, 20)):
        f.runs[("none", rtt)] = [_run(report, 60 + extra, 1)]
        f.runs[("lookup", rtt)] = [_run(report, 61 + extra, 1, accepted=0)]
        for k in (1, 2, 3):
            f.runs[(f"known{k}", rtt)] = [_run(report, 60 + 30 * k + extra, k + 1)]
    f.late_ms = {0.0: [0.5], 5.0: [0.6]}
    text = report.render(f, "python bench/latency.py", "a machine")
    assert "| 5 | none | **12.50** (12.5) | 1.00 |" in text
    assert "accept 0.82 (published), k = 2" in text
    assert text.count("| 0 | ") == text.count("| 5 | ") == 5 + 3 + 2  # measured, published, breakdown
    assert "Prompt lookup drafted nothing" in text
    assert "0 hedged calls" in text


def test_each_node_holds_a_disjoint_quarter(report: ModuleType) -> None:
    from _latency_swarm import quarters

    assert quarters(256, 4) == ["0-63", "64-127", "128-191", "192-255"]
    assert quarters(10, 4) == ["0-1", "2-4", "5-6", "7-9"]


def test_the_row_cost_matrix_is_the_q8_0_it_says(report: ModuleType) -> None:
    import numpy as np
    import torch
    from _latency_rows import q8_0_matrix

    from swarm.compute.dense import linear

    w = q8_0_matrix(64, 64, seed=3)
    raw = np.asarray(w.keep).reshape(-1, 34)
    values = raw[:, 2:].view(np.int8).astype(np.float32).reshape(64, 64) * np.float32(np.float16(0.01))
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    (y,) = linear([w], x)
    want = x.numpy() @ values.T
    # ggml multiplies the row quantized to Q8_0 too: close, not equal
    np.testing.assert_allclose(y.numpy(), want, rtol=0.02, atol=0.02 * np.abs(want).max())
