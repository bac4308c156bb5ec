"""Answers checked by random projections (swarm.coordinator.checks.projection): honest answers of the real
kernels pass on every weight type and numerics the fixtures carry, and each kind of liar fails at its
first answer."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, flip_bytes

from swarm.compute.rowquant import kernel_values, quantize_rows
from swarm.compute.slabs import load_slabs
from swarm.compute.store import ExpertStore
from swarm.coordinator.checks import audit, projection
from swarm.coordinator.checks.projection import Projections
from swarm.proto import expert_pb2 as pb
from swarm.proto.codec import decode_array
from swarm.proto.numerics import Numerics
from swarm.sharding.gguf_io import open_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _bound_builds import edge_rows, neon_rows  # noqa: E402  (ARM's row quantizers, in numpy)

QUANT = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"  # Q4_K gate/up, Q4_K and Q6_K down
FILES = [
    FIXTURES / "qwen35moe-tiny" / "model-f32.gguf",
    FIXTURES / "qwen35moe-tiny" / "model-bf16.gguf",
    FIXTURES / "qwen35moe-quant" / "model-q8_0.gguf",
    QUANT,
    FIXTURES / "qwen3next-tiny" / "model-f32.gguf",
    FIXTURES / "qwen2moe-tiny" / "model-f32.gguf",
    FIXTURES / "qwen3moe-tiny" / "model-f32.gguf",
]
NUMERICS = [Numerics.NATIVE, Numerics.EXACT]


def _store(path) -> ExpertStore:
    return ExpertStore(load_slabs(path, verify=False).slabs, "cpu")


def _rows(rng: np.random.Generator, n: int, d: int, trial: int) -> np.ndarray:
    """Rows of several scales, some with the outlier columns real activations have."""
    x = rng.standard_normal((n, d)).astype(np.float32) * np.float32([0.01, 1.0, 30.0][trial % 3])
    if trial % 2:
        x[:, rng.integers(0, d, 3)] *= 50
    return x


def _call(store: ExpertStore, rng: np.random.Generator, layer: int, trial: int):
    held = sorted(e for n, e in store.held() if n == layer)
    ids = [int(e) for e in rng.choice(held, min(4, len(held)), replace=False)]
    counts = [int(c) for c in rng.integers(1, 5, len(ids))]
    return ids, counts, _rows(rng, sum(counts), store.hidden_size, trial)


@pytest.fixture(scope="module", params=FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def store(request):
    return _store(request.param)


@pytest.mark.parametrize("numerics", NUMERICS, ids=lambda n: n.value)
def test_honest_answers_of_the_real_kernels_pass(store, numerics):
    """Hundreds of calls on every layer, rows of every scale: no false alarm, and the residuals sit well
    inside the tolerance (a tenth of it and less: the margin the bound's derivation leaves)."""
    checks = Projections(store, projections=2, seed=1)
    rng = np.random.default_rng(0)
    native = numerics is Numerics.NATIVE
    for layer in store.layers():
        for trial in range(12):
            ids, counts, x = _call(store, rng, layer, trial)
            y, inner = store.compute_inner(layer, ids, counts, x, numerics)
            assert checks.check(layer, ids, counts, x, y, inner, native) is None
    assert checks.failures == 0 and checks.checks == 12 * len(store.layers())


def test_the_rows_are_those_the_kernel_multiplied():
    """Q8_K and Q8_0 rows as ggml's quantizer makes them: each block's d times its int8 values, exactly (a
    float64 product), within half a step of the row; F16 rows rounded as ggml rounds them."""
    x = np.random.default_rng(3).standard_normal((3, 256)).astype(np.float32)
    for weight_type, act, block in ((12, 15, 256), (8, 8, 32)):  # Q4_K pairs with Q8_K, Q8_0 with Q8_0
        made = kernel_values(x, weight_type)
        assert made is not None and made.dtype == np.float64
        q = quantize_rows(x, act)
        assert len(q.tobytes()) > 0
        steps = made.reshape(3, -1, block)
        d = np.abs(steps).max(axis=2, keepdims=True) / 127
        ints = steps / d
        assert np.allclose(ints, np.round(ints), atol=1e-6)
        assert (np.abs(made - x).reshape(3, -1, block) <= d * 0.6).all()  # (Q8_0: q times d rounded to F16)
    assert np.array_equal(kernel_values(x, 1), x.astype(np.float16).astype(np.float64))
    assert kernel_values(x, 0).dtype == np.float64


def _liar_answers(store: ExpertStore, how: str, layer: int, ids, counts, x, rng):
    """(answer, inner) of a node lying `how` on this call."""
    y, inner = store.compute_inner(layer, ids, counts, x)
    if how == "scaled":
        return y * np.float32(1 + 1e-4), inner
    if how == "one element":
        y = y.copy()
        y[0, 7] += 1e-3 * np.abs(y[0]).max()
        return y, inner
    if how == "another row":
        return np.roll(y, 1, axis=0), np.roll(inner, 1, axis=0)
    if how == "another expert":
        other = [sorted(e for n, e in store.held() if n == layer and e != i)[0] for i in ids]
        return store.compute_inner(layer, other, counts, x)
    if how == "replayed":
        return store.compute_inner(layer, ids, counts, _rows(rng, x.shape[0], x.shape[1], 1))
    if how == "consistent gate":  # gate, up and answer agree with each other, not with the rows sent
        return store.compute_inner(layer, ids, counts, x * np.float32(1 + 1e-3))
    if how == "gate only":
        inner = inner.copy()
        inner[0, 3] *= np.float32(1.001)
        return y, inner
    raise AssertionError(how)


LIES = ["scaled", "one element", "another row", "another expert", "replayed", "consistent gate", "gate only"]


@pytest.mark.parametrize("how", LIES)
def test_each_liar_fails_at_its_first_answer(how):
    store = _store(QUANT)
    checks = Projections(store, seed=2)
    rng = np.random.default_rng(5)
    for layer in store.layers():
        ids, counts, x = _call(store, rng, layer, 1)
        y, inner = _liar_answers(store, how, layer, ids, counts, x, rng)
        failed = checks.check(layer, ids, counts, x, y, inner)
        assert failed is not None, f"layer {layer}: {how} passed"
        assert failed.worst > 1.5, failed  # not at the edge of the tolerance


def test_a_node_computing_from_altered_expert_bytes_fails(tmp_path):
    """A GGUF whose layer-0 expert bytes differ under the same header (bit rot, or weights swapped in)."""
    altered = tmp_path / "altered.gguf"
    altered.write_bytes(QUANT.read_bytes())
    for t in open_gguf(altered).tensors:
        if t.name.startswith("blk.0.ffn_") and "_exps" in t.name:
            flip_bytes(altered, int(t.data_offset), int(t.data_offset) + int(t.n_bytes), every=4099)
    honest, liar = _store(QUANT), _store(altered)
    checks = Projections(honest, seed=3)
    rng = np.random.default_rng(6)
    for expert in sorted(e for n, e in honest.held() if n == 0):
        x = _rows(rng, 2, honest.hidden_size, expert)
        y, inner = liar.compute_inner(0, [expert], [2], x)
        assert checks.check(0, [expert], [2], x, y, inner) is not None, expert


def test_float16_answers_pass_within_their_rounding():
    store = _store(QUANT)
    checks = Projections(store, seed=4)
    rng = np.random.default_rng(7)
    ids, counts, x = _call(store, rng, 1, 2)
    y, inner = store.compute_inner(1, ids, counts, x)
    half = y.astype(np.float16).astype(np.float32)
    assert checks.check(1, ids, counts, x, half, inner) is not None  # rounded: not float32 noise any more
    assert checks.check(1, ids, counts, x, half, inner, answer_unit=2.0**-11) is None


def test_the_vectors_are_what_stays_resident():
    """Per expert, D + F float32 a projection (gate and up share one vector): bench/trust.py scales it to
    the real shapes."""
    store = _store(QUANT)
    checks = Projections(store, projections=2, seed=5)
    checks.prepare()
    d, f = store.hidden_size, store.ffn_width(0, 0)
    assert checks.nbytes == len(store.held()) * 2 * (d + f) * 4


def test_bad_shapes_fail_rather_than_pass():
    store = _store(QUANT)
    checks = Projections(store, seed=6)
    x = np.zeros((2, store.hidden_size), np.float32)
    y, inner = store.compute_inner(0, [0], [2], x)
    assert checks.check(0, [0], [2], x, y[:1], inner) is not None
    assert checks.check(0, [0], [2], x, y, inner[:, :10]) is not None
    nan = y.copy()
    nan[1, 0] = np.nan
    assert checks.check(0, [0], [2], x, nan, inner) is not None
    # inner products whose bytes are no array (read when checked, not when the answer arrived): a failed check
    garbled = pb.Tensor(dtype=pb.F32_PLANES, shape=list(inner.shape), data=b"\x00" * 7)
    read = audit._inner("127.0.0.1:1", lambda: decode_array(garbled))
    assert read.shape == (0, 0) and checks.check(0, [0], [2], x, y, read) is not None
    assert checks.check(0, [0], [2], x, y, audit._inner("127.0.0.1:1", lambda: inner)) is None


def test_r_is_secret_per_coordinator():
    store = _store(QUANT)
    a, b = Projections(store), Projections(store)
    assert not np.array_equal(a.secret(256, 256)[0], b.secret(256, 256)[0])
    assert projection.PROJECTIONS >= 1


def test_another_class_may_round_h_the_other_way_near_a_boundary():
    """A node of another numerics class: its g and u a few ulps off ours, so its h may take the other Q8
    step where an element lies near a boundary. Those steps are allowed for it, and only for it; a lie is
    still caught."""
    store = _store(QUANT)
    checks = Projections(store, seed=8)
    rng = np.random.default_rng(9)
    flagged = 0
    for layer in store.layers():
        for trial in range(30):
            ids, counts, x = _call(store, rng, layer, trial)
            y, inner = store.compute_inner(layer, ids, counts, x)
            ulps = rng.integers(-3, 4, inner.shape).astype(np.float32)
            theirs = inner + ulps * np.spacing(np.abs(inner))  # their sums' other order
            assert checks.check(layer, ids, counts, x, y, theirs, other_class=True) is None
            flagged += checks.check(layer, ids, counts, x, y, theirs) is not None
            assert checks.check(layer, ids, counts, x, y * np.float32(1 + 1e-3), theirs, other_class=True)
    assert flagged > 0  # without the allowance, such steps would be alarms (then exact recomputes)



@pytest.mark.parametrize("path, kind", [(FIXTURES / "qwen35moe-quant" / "model-q8_0.gguf", 8), (QUANT, 15)],
                         ids=["Q8_0 rows", "Q8_K rows"])  # fmt: skip
def test_another_class_may_round_x_the_other_way_near_a_boundary(path, kind):
    """An ARM node quantizes the rows sent by its own code, which rounds an element lying within about an ulp
    of a step the other way (about 1.3 in a million; bench/bound_builds.py measured it on the ARM builds): its
    honest gate and up products are then those of a row one step off ours in that element, far outside float32
    noise. The step is allowed for a node of another class, and only for it; a lie is still caught."""
    store = _store(path)
    x = edge_rows(store.hidden_size, 3, seed=10, kind=kind)
    theirs = neon_rows(x, kind)  # rows this host's kernels quantize as the ARM node quantizes x
    checks = Projections(store, seed=11)
    for layer in store.layers():
        ids, counts = [0], [len(x)]
        y, inner = store.compute_inner(layer, ids, counts, theirs)  # the ARM node's honest answer to x
        assert checks.check(layer, ids, counts, x, y, inner, other_class=True) is None
        failed = checks.check(layer, ids, counts, x, y, inner)
        assert failed is not None and failed.what == "gate/up"  # of our class, such rows would be a lie
        assert checks.check(layer, ids, counts, x, y * np.float32(1 + 1e-3), inner, other_class=True)
