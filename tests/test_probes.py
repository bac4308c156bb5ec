"""swarm.compute.probes: for which weight types a batch gives each row the bits it gets alone, decided on the
build from products, never assumed. The decision is a pure function of (batched, alone) products, fed here
with products recorded on a real arm64 ggml build with int8 matrix instructions (i8mm), run under qemu-user
(deploy/arm/; `python bench/_arm_kernels.py probe OUT` made the file), where ggml's 2-row kernels give a row
of an even batch other bits; and the probe on this machine's own build, checked against what batches do here
and through the graphs a node runs (numpy in, numpy out).
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES
from gguf import GGMLQuantizationType

from swarm.compute import ffn, probes, weights
from swarm.compute import graph as graph_module
from swarm.compute.graph import Graph, repacked_rows_independent

Q = GGMLQuantizationType
I8MM_ROWS = FIXTURES / "probes" / "dotprod-i8mm-batch-rows.npz"
# the types whose ggml vec_dot takes two rows at once on a CPU with int8 matrix instructions
TWO_ROW_TYPES = {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"}
# every type `swarm synth` writes and real Qwen files use (test_kernels' list)
TYPES = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ4_NL, Q.IQ2_XS, Q.IQ1_M,
]  # fmt: skip
D, F = 512, 256


def recorded() -> tuple[dict, dict[str, tuple[dict[int, np.ndarray], np.ndarray]]]:
    """(meta, {type: (batched, alone)}) of the i8mm recording."""
    with np.load(I8MM_ROWS) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays.pop("meta")))
    out = {}
    for name in meta["rows_independent"]:
        batched = {n: arrays[f"{name}/{n}"] for n in meta["probe_rows"]}
        out[name] = (batched, arrays[f"{name}/alone"])
    return meta, out


def some_row_differs(batched: dict[int, np.ndarray], alone: np.ndarray) -> bool:
    """Row by row, as bytes: the plain reading the decision must agree with."""
    return any(y[i].tobytes() != alone[i].tobytes() for n, y in batched.items() for i in range(n))


def test_the_decision_flags_exactly_the_i8mm_types_whose_recorded_rows_differ():
    meta, products = recorded()
    assert meta["machine"] == "aarch64" and meta["ggml_features"]["matmul_int8"] == 1, meta
    assert not meta["ggml_features"]["llamafile"]  # the 2-row kernels alone, not tinyBLAS
    flagged = {name for name, (b, a) in products.items() if not probes.batch_keeps_rows(b, a)}
    differ = {name for name, (b, a) in products.items() if some_row_differs(b, a)}
    assert flagged == differ == TWO_ROW_TYPES, (flagged, differ)
    assert set(products) - TWO_ROW_TYPES, "the recording has types that keep their rows too"
    # and the probe, run live on that build, said the same
    assert {name for name, ok in meta["rows_independent"].items() if not ok} == TWO_ROW_TYPES
    # the odd batch (7 rows) takes the one-row kernel there: only the even ones differ
    for name in TWO_ROW_TYPES:
        batched, alone = products[name]
        assert probes.batch_keeps_rows({7: batched[7]}, alone), name
        assert not probes.batch_keeps_rows({8: batched[8]}, alone), name


def test_the_decision_compares_bits():
    alone = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    alone[3, 5] = np.nan
    batched = {n: alone[:n].copy() for n in (2, 4, 7, 8)}
    assert probes.batch_keeps_rows(batched, alone)  # the same NaN bits are the same answer
    nudged = {**batched, 8: batched[8].copy()}
    nudged[8][6, 2] = np.nextafter(nudged[8][6, 2], np.float32(np.inf))  # one ulp, in one element
    assert not probes.batch_keeps_rows(nudged, alone)
    signed = {2: alone[:2].copy()}
    alone0 = alone.copy()
    alone0[1, 1], signed[2][1, 1] = 0.0, -0.0  # equal as numbers, other bits
    assert not probes.batch_keeps_rows(signed, alone0)
    with pytest.raises(ValueError):
        probes.batch_keeps_rows({9: np.zeros((9, 16), np.float32)}, alone)  # more rows than were done alone
    with pytest.raises(ValueError):
        probes.batch_keeps_rows({}, alone)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_live_probe_says_what_other_batches_do_on_this_build(qtype):
    """The probe's verdict against batches of other sizes of another matrix: rows of each batch against
    the same rows alone, weight as stored (ggml picks its kernel by the row count)."""
    q = int(qtype)
    w = probes.probe_weight(q, 48, 768, seed=5)
    x = np.random.default_rng(6).standard_normal((16, 768)).astype(np.float32)
    alone = np.concatenate([probes.product(w, q, 48, x[i : i + 1]) for i in range(16)])
    batched = {n: probes.product(w, q, 48, x[:n]) for n in (2, 3, 6, 16)}
    assert probes.rows_independent(q) == (not some_row_differs(batched, alone))
    if platform.machine() in ("x86_64", "AMD64") and qtype.name in TWO_ROW_TYPES:
        assert probes.rows_independent(q)  # x86's kernels take one row at a time (or tinyBLAS, exact here)


def dense_through_graph(w: weights.Weight, x: np.ndarray, plain: bool = False) -> np.ndarray:
    """x [n, I] times w in a graph of one product (Graph.mul_mat; `plain`: one plain ggml batch, whatever
    ggml's batched kernels do to a row's bits), numpy in and out."""
    n = int(x.shape[0])
    gr = Graph(4)
    try:
        wt, xt = gr.weight(w), gr.input(w.cols, n)
        gr.output(gr.g.ggml_mul_mat(gr.ctx, wt, xt) if plain else gr.mul_mat(wt, xt))
        out = np.empty((n, w.rows), np.float32)
        gr.build().run([np.ascontiguousarray(x)], [out])
        return out
    finally:
        gr.free()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_batch_through_the_graphs_equals_its_rows_alone(qtype):
    """What a node runs, numpy in and out: a dense product and an expert's FFN (gate, up, SwiGLU, down) on
    weights as a node holds them (repacked where ggml has a layout for them here), 9 rows at once against
    each row alone."""
    q = int(qtype)
    x = np.random.default_rng(1).standard_normal((9, D)).astype(np.float32)

    def held(rows: int, cols: int, seed: int) -> weights.Weight:
        return weights.repacked(
            weights.Weight.of_bytes(probes.probe_weight(q, rows, cols, seed), q, (rows, cols))
        )

    dense = held(F, D, 1)
    together = dense_through_graph(dense, x)
    assert together.dtype == np.float32 and together.shape == (9, F)
    alone = np.concatenate([dense_through_graph(dense, x[i : i + 1]) for i in range(9)])
    assert np.array_equal(together.view(np.uint32), alone.view(np.uint32))
    f = ffn.FFN(down=held(D, F, 2), gate=held(F, D, 3), up=held(F, D, 4))
    together = ffn.ffn(f, x)
    assert isinstance(together, np.ndarray) and np.isfinite(together).all()
    alone = np.concatenate([ffn.ffn(f, x[i : i + 1]) for i in range(9)])
    assert np.array_equal(together.view(np.uint32), alone.view(np.uint32))


def repacked_weight(q: int, rows: int, cols: int, seed: int) -> weights.Weight | None:
    w = weights.repacked(weights.Weight.of_bytes(probes.probe_weight(q, rows, cols, seed), q, (rows, cols)))
    return w if w.repack is not None else None


def plain_batch(w: weights.Weight, x: np.ndarray) -> np.ndarray:
    return dense_through_graph(w, x, plain=True)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_repacked_probe_says_what_other_batches_do_on_this_build(qtype):
    """A repacked layout's verdict against batches of other sizes of another matrix (the repacked GEMM takes
    planes of 4 rows, the GEMV the rest); a type with no repacked layout here is never called independent."""
    q = int(qtype)
    w = repacked_weight(q, 48, 768, seed=5)
    if w is None:
        assert not repacked_rows_independent(q)
        return
    x = np.random.default_rng(6).standard_normal((16, 768)).astype(np.float32)
    alone = np.concatenate([plain_batch(w, x[i : i + 1]) for i in range(16)])
    batched = {n: plain_batch(w, x[:n]) for n in (3, 5, 12, 16)}
    assert repacked_rows_independent(q) == (not some_row_differs(batched, alone))


def test_without_the_repacked_probes_choice_a_batch_changes_rows(monkeypatch):
    """The verdict matters: a repacked type whose GEMM sums otherwise (Q4_K on x86), said to keep its rows,
    is multiplied as one batch and its rows come out other than alone."""
    changed = [q for q in TYPES if repacked_weight(int(q), F, D, 1) is not None and not repacked_rows_independent(int(q))]
    if not changed:
        pytest.skip("no repacked layout here sums a batch otherwise than one row: nothing to take away")
    q = int(changed[0])
    w = repacked_weight(q, F, D, 1)
    assert w is not None
    monkeypatch.setitem(graph_module._repacked_independent, q, True)
    x = np.random.default_rng(1).standard_normal((8, D)).astype(np.float32)
    alone = np.concatenate([dense_through_graph(w, x[i : i + 1]) for i in range(8)])
    assert not np.array_equal(dense_through_graph(w, x).view(np.uint32), alone.view(np.uint32))


def test_without_the_probes_choice_a_batch_changes_rows(monkeypatch):
    """The test above can fail: told that a type whose batches change rows on this build keeps them (as
    the llamafile-only probe said of every type on ARM), Graph.mul_mat multiplies the rows together and
    they come out other than alone."""
    changed = [q for q in TYPES if probes.has_kernel(int(q)) and not probes.rows_independent(int(q))]
    if not changed:
        pytest.skip("every type keeps its rows in a batch on this build: nothing to take away")
    q = int(changed[0])
    monkeypatch.setitem(probes._independent, q, True)
    w = weights.Weight.of_bytes(probes.probe_weight(q, F, D, 1), q, (F, D))
    x = np.random.default_rng(1).standard_normal((8, D)).astype(np.float32)
    alone = np.concatenate([dense_through_graph(w, x[i : i + 1]) for i in range(8)])
    assert not np.array_equal(dense_through_graph(w, x).view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize("name", sorted(TWO_ROW_TYPES))
def test_a_flagged_type_is_multiplied_one_row_at_a_time(monkeypatch, name):
    """Where the probe flags a type (as it does these on an i8mm build), Graph.mul_mat gives ggml the
    batch as one-row products ([I, 1, N]: ggml's 2-row kernels need two rows in one batch)."""
    q = int(Q[name])
    w = weights.Weight.of_bytes(probes.probe_weight(q, F, D, 1), q, (F, D))
    for verdict, rows_per_product in ((True, 8), (False, 1)):
        monkeypatch.setitem(probes._independent, q, verdict)
        gr = Graph(4)
        try:
            y = gr.mul_mat(gr.weight(w), gr.input(D, 8))
            while y.contents.op == gr.g.GGML_OP_RESHAPE:
                y = y.contents.view_src
            assert y.contents.op == gr.g.GGML_OP_MUL_MAT
            assert int(y.contents.src[1].contents.ne[1]) == rows_per_product, verdict
        finally:
            gr.free()


def test_the_probe_runs_without_torch():
    code = (
        "import sys\n"
        "from swarm.compute import probes\n"
        "probes.rows_independent(8); probes.rows_independent(12)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
