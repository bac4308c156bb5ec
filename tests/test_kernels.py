"""ggml's kernels as swarm.compute drives them: every GGUF type we meet, both numerics, row independence.

References are float64 products of gguf-py's dequantization (independent of ggml). The native numerics
rounds each activation row to the type its kernel pairs with (8-bit blocks for the quant types, BF16 or F16
for those weights), so it sits within about a percent of the float64 product; the exact numerics within
float32 rounding.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from test_dequant import random_blocks, reference

from swarm.compute import deltanet, dense, ffn, ggml, graph, probes, weights

Q = GGMLQuantizationType
# every type `swarm synth` writes and real Qwen files use
TYPES = [
    Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS, Q.IQ4_NL, Q.IQ2_XS, Q.IQ1_M,
]  # fmt: skip
ROWS, COLS = 48, 512  # COLS: whole 256-value super-blocks


def random_weights(qtype: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    if qtype == Q.F32:
        return np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)
    if qtype == Q.F16:
        return np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:  # the top half of float32 normals (random bit patterns reach 1e38)
        f = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, ROWS * COLS // block, seed=seed + int(qtype)).reshape(-1, size)
    if qtype in (Q.IQ4_XS, Q.IQ2_XS):  # their float16 scale d leads the block: make it a sane 2^-7
        raw[:, 0:2] = np.array([0x2000], dtype=np.uint16).view(np.uint8)
    if qtype == Q.IQ1_M:  # its float16 scale is the top nibbles of the 4 scale words at byte 48
        words = np.ascontiguousarray(raw[:, 48:56]).view(np.uint16)
        words &= 0x0FFF
        words[:, 3] |= 0x2000
        raw[:, 48:56] = words.view(np.uint8)
    return raw.reshape(ROWS, -1)


def rel_err(got: torch.Tensor, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.double().numpy() - want) / np.linalg.norm(want))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_every_type_is_multiplied_as_stored_in_both_numerics(qtype: GGMLQuantizationType) -> None:
    assert probes.has_kernel(qtype)
    raw = random_weights(qtype)
    ref = reference(raw, qtype, (ROWS, COLS)).astype(np.float64)  # [O, I]
    x = torch.randn(7, COLS, generator=torch.Generator().manual_seed(int(qtype)))
    want = x.double().numpy() @ ref.T
    native = weights.stored_weight(raw, qtype, (ROWS, COLS), "native")
    assert native.qtype == int(qtype)
    if native.repack is None:  # the stored bytes, in place
        assert native.ptr == raw.ctypes.data
    else:  # or ggml's repacked copy of them (Q4_0, Q4_K, IQ4_NL on x86), which still knows the file's bytes
        assert native.ptr != raw.ctypes.data and native.stored is raw
    (got,) = dense.linear([native], x)
    tol = 1e-6 if qtype == Q.F32 else 4e-2  # the activations are rounded to 8 bits (or bf16/f16)
    assert rel_err(got, want) <= tol
    exact = weights.stored_weight(raw, qtype, (ROWS, COLS), "exact")
    assert exact.qtype == int(Q.F32)
    (got_exact,) = dense.linear([exact], x)
    assert rel_err(got_exact, want) <= 1e-6
    if qtype not in (Q.F32,):
        assert not torch.equal(got, got_exact), "the native numerics really rounds the activations"


@pytest.mark.parametrize("numerics", ["native", "exact"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_row_is_the_same_alone_or_in_any_batch(qtype: GGMLQuantizationType, numerics: str) -> None:
    """Whichever kernel ggml picks for a batch (tinyBLAS GEMM for 2+ rows of the types where it sums as
    vec_dot does, vec_dot row by row for the rest), each row's bits are its bits alone."""
    w = weights.stored_weight(random_weights(qtype), qtype, (ROWS, COLS), numerics)  # type: ignore[arg-type]
    x = torch.randn(37, COLS, generator=torch.Generator().manual_seed(1))
    (full,) = dense.linear([w], x)
    for n in (1, 2, 3, 8, 16, 17):
        (part,) = dense.linear([w], x[:n].clone())
        assert torch.equal(part, full[:n]), f"{n} rows"
    alone = torch.cat([dense.linear([w], x[i : i + 1].clone())[0] for i in range(37)])
    assert torch.equal(alone, full)


def test_the_first_batched_product_of_a_process_is_right() -> None:
    """The first product of several rows checks this build's tinyBLAS on graphs of its own, in the middle
    of building the caller's graph: a fresh process gets each row's bits alone."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import torch
        from gguf import GGMLQuantizationType as Q
        from test_kernels import COLS, ROWS, random_weights
        from swarm.compute import deltanet, dense, ffn, ggml, graph, probes, weights
        ws = [weights.stored_weight(random_weights(q), q, (ROWS, COLS), "native") for q in (Q.Q8_0, Q.F16, Q.Q5_0)]
        x = torch.randn(9, COLS, generator=torch.Generator().manual_seed(0))
        together = dense.linear(ws, x)  # the first batched product: probes run mid-build
        for w, t in zip(ws, together):
            alone = torch.cat([dense.linear([w], x[i : i + 1].clone())[0] for i in range(9)])
            assert torch.equal(t, alone), w.qtype
        print("ok")
        """
    )
    tests = str(Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": tests})  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_several_projections_of_one_input_equal_each_alone() -> None:
    ws = [weights.stored_weight(random_weights(q), q, (ROWS, COLS), "native") for q in (Q.Q4_K, Q.Q6_K, Q.Q8_0)]
    x = torch.randn(3, COLS)
    together = dense.linear(ws, x)
    for w, t in zip(ws, together, strict=True):
        assert torch.equal(dense.linear([w], x)[0], t)


def test_an_ffn_graph_equals_its_parts() -> None:
    """down(silu(gate x) * up x), one graph for several FFNs, each block of rows its own."""
    d, f = COLS, ROWS

    def w(q: GGMLQuantizationType, shape: tuple[int, int], seed: int) -> weights.Weight:
        block, _ = GGML_QUANT_SIZES[q]
        raw = random_blocks(q, shape[0] * shape[1] // block, seed=seed).reshape(shape[0], -1)
        return weights.stored_weight(raw, q, shape, "exact")

    ffns = [ffn.FFN(down=w(Q.Q8_0, (d, f * 4), s), gate=w(Q.Q4_K, (f * 4, d), s + 1),
                        up=w(Q.Q4_K, (f * 4, d), s + 2)) for s in (0, 10)]  # fmt: skip
    x = torch.randn(5, d)
    out = torch.empty_like(x)
    ffn.ffn_rows([(ffns[0], 0, 2), (ffns[1], 2, 3)], x, out)
    for f_, rows in ((ffns[0], slice(0, 2)), (ffns[1], slice(2, 5))):
        g, u = (dense.linear([m], x[rows])[0] for m in (f_.gate, f_.up))
        h = torch.nn.functional.silu(g.double()) * u.double()
        ref = dense.linear([f_.down], h.float())[0]
        torch.testing.assert_close(out[rows], ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(ffn.ffn(f_, x[rows]), out[rows])


@pytest.mark.parametrize("gated, normed, bias", [(True, True, False), (False, True, False), (False, False, True)],
                         ids=["gated-qwen35", "qk-norm-qwen3", "bias-qwen2"])  # fmt: skip
def test_attention_heads_equal_their_definition_and_each_row_alone(
    gated: bool, normed: bool, bias: bool
) -> None:
    """The attention front graph against the norms, biases, NeoX RoPE and sigmoid written out in float64
    (a partial rotation: n_rot < hd); a row's bits do not depend on the rows beside it."""
    from swarm.coordinator.models.attention import rope
    from swarm.coordinator.models.linear import rms_norm

    d, h, hkv, hd, n_rot, base, eps = COLS, 4, 2, 64, 16, 1e7, 1e-6
    shapes = [("q", ((2 if gated else 1) * h * hd, d)), ("k", (hkv * hd, d)), ("v", (hkv * hd, d))]
    mats = {name: np.random.default_rng(s).standard_normal(shape).astype(np.float32) * 0.05
            for s, (name, shape) in enumerate(shapes)}  # fmt: skip
    ws = [weights.stored_weight(mats[m], Q.F32, mats[m].shape, "native") for m in "qkv"]
    biases = {m: torch.randn(mats[m].shape[0]) * 0.1 for m in "qkv"}
    posts = [(("add", biases[m]),) if bias else None for m in "qkv"]
    nw, qw, kw = torch.rand(d) + 0.5, torch.rand(hd) + 0.5, torch.rand(hd) + 0.5
    heads = dense.Heads(h, hkv, hd, n_rot, base, dense.Norm(qw, eps) if normed else None,
                          dense.Norm(kw, eps) if normed else None, gated)  # fmt: skip
    x = torch.randn(7, d)
    pos = torch.tensor([0, 1, 2, 3, 63, 64, 200])
    got = dense.attention_heads(x, dense.Norm(nw, eps), ws, posts, heads, pos)

    xn = rms_norm(x.double(), nw.double(), eps)
    qx, kx, vx = (
        xn @ torch.from_numpy(mats[m]).double().T + (biases[m].double() if bias else 0) for m in "qkv"
    )
    qg = qx.view(7, h, 2, hd) if gated else qx.view(7, h, 1, hd)
    q, k = qg[:, :, 0], kx.view(7, hkv, hd)
    if normed:
        q, k = rms_norm(q, qw.double(), eps), rms_norm(k, kw.double(), eps)
    want = [rope(q, pos, n_rot, base), rope(k, pos, n_rot, base), vx]
    want.append(torch.sigmoid(qg[:, :, 1].reshape(7, -1)) if gated else None)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)
    for i in range(7):
        alone = dense.attention_heads(x[i : i + 1], dense.Norm(nw, eps), ws, posts, heads, pos[i : i + 1])
        for a, full in zip(alone, got, strict=True):
            assert (a is None and full is None) or torch.equal(a[0], full[i])


@pytest.mark.parametrize("op", ["sigmoid", "silu", "softplus", "exp"])
def test_unary_rows_do_not_depend_on_the_batch(op: str) -> None:
    x = torch.randn(61, 5)  # an odd width: torch's vectorized tail would round some positions apart
    full = dense.unary(op, x)
    ref = {"sigmoid": torch.sigmoid, "silu": torch.nn.functional.silu, "softplus": torch.nn.functional.softplus,
           "exp": torch.exp}[op](x.double())  # fmt: skip
    torch.testing.assert_close(full.double(), ref, rtol=1e-6, atol=1e-7)
    for n in (1, 2, 7, 33):
        assert torch.equal(dense.unary(op, x[-n:].clone()), full[-n:])


@pytest.mark.parametrize("grouped", [False, True], ids=["tiled", "grouped"])
def test_the_delta_net_step_equals_the_definition(grouped: bool) -> None:
    """Conv, SiLU, L2 norms and the gated delta rule in one ggml graph against torch's conv and the rule
    step by step (float64), value heads reading key heads tiled (qwen35moe) or in blocks (qwen3next)."""
    from swarm.coordinator.models.deltanet import L2_EPS, causal_conv, gated_delta_recurrent, l2_norm

    b, t, hk, hv, s, kc = 2, 5, 2, 4, 16, 4
    c = 2 * hk * s + hv * s
    gen = torch.Generator().manual_seed(3)
    window = torch.randn(b, c, kc - 1 + t, generator=gen)
    w = torch.randn(c, kc, generator=gen) * 0.5
    g, beta = -torch.rand(b, t, hv, generator=gen), torch.rand(b, t, hv, generator=gen)
    state = torch.randn(b, hv, s, s, generator=gen)  # ggml layout: state[b, h, j, i] = S[i, j]
    convs, mixed = (
        [window[i, :, : kc - 1].contiguous() for i in range(b)],
        window[:, :, kc - 1 :].transpose(1, 2),
    )
    rule = deltanet.DeltaRule(w, hk, grouped, L2_EPS)
    o, new_convs, new = deltanet.delta_net_step(mixed, convs, g, beta, list(state), rule)
    key_of = [h // (hv // hk) if grouped else h % hk for h in range(hv)]
    for i in range(b):
        conv, _ = causal_conv(window[i, :, kc - 1 :].T.double(), window[i, :, : kc - 1].double(), w.double())
        act = torch.nn.functional.silu(conv)  # [T, C]
        q = l2_norm(act[:, : hk * s].reshape(t, hk, s), L2_EPS)[:, key_of]
        k = l2_norm(act[:, hk * s : 2 * hk * s].reshape(t, hk, s), L2_EPS)[:, key_of]
        v = act[:, 2 * hk * s :].reshape(t, hv, s)
        ro, rs = gated_delta_recurrent((q / s**0.5).transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       g[i].T.double(), beta[i].T.double(), state[i].transpose(-1, -2).double())  # fmt: skip
        torch.testing.assert_close(o[i].transpose(0, 1).double(), ro, rtol=1e-4, atol=1e-4)  # o[i] [T, Hv, S]
        torch.testing.assert_close(new[i].transpose(-1, -2).double(), rs, rtol=1e-4, atol=1e-4)
        assert torch.equal(new_convs[i], window[i, :, t:])  # the last Kc-1 inputs
        alone = deltanet.delta_net_step(mixed[i : i + 1], convs[i : i + 1], g[i : i + 1], beta[i : i + 1],
                                       [state[i]], rule)  # fmt: skip
        assert torch.equal(alone[0][0], o[i]) and torch.equal(alone[2][0], new[i])
        assert torch.equal(alone[1][0], new_convs[i])


def test_a_type_without_a_kernel_falls_back_to_the_exact_path_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every type gguf-py can read has a ggml kernel today; pretend Q4_K had none.
    assert not probes.has_kernel(Q.Q8_K)  # an activation-only type
    qtype = Q.Q4_K
    monkeypatch.setattr(probes, "has_kernel", lambda q: int(q) != int(Q.Q4_K))
    monkeypatch.setattr(probes, "_warned", set())
    block, size = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 4 * COLS // block, seed=5).reshape(4, -1)
    with caplog.at_level(logging.WARNING, logger="swarm.compute.probes"):
        w1 = weights.stored_weight(raw, qtype, (4, COLS), "native", "test weight")
        w2 = weights.stored_weight(raw, qtype, (4, COLS), "native", "test weight")
    assert w1.qtype == w2.qtype == int(Q.F32)
    assert len([r for r in caplog.records if "Q4_K" in r.message]) == 1
    x = torch.randn(2, COLS)
    want = x.double().numpy() @ reference(raw, qtype, (4, COLS)).astype(np.float64).T
    assert rel_err(dense.linear([w1], x)[0], want) <= 1e-6


def test_threads_are_one_budget() -> None:
    before = ggml.threads()
    try:
        ggml.set_threads(1)
        assert ggml.threads() == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError):
            ggml.set_threads(0)
    finally:
        ggml.set_threads(before)


def test_x86_kernels_are_built_for_the_avx2_baseline_with_tinyblas() -> None:
    """The same slab must give the same bits on AVX2 and AVX-512 machines (audits compare for equality, and
    llama.cpp's own kernels take the AVX2 paths there): ggml is built without its AVX-512 paths on x86
    (the README's install command)."""
    import platform

    from swarm.compute.ggml import ggml_lib

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the AVX2 baseline is an x86 build choice; this is {platform.machine()}")
    g = ggml_lib()
    assert g.ggml_cpu_has_avx2() and not g.ggml_cpu_has_avx512(), (
        "ggml-python was built with AVX-512 kernels: reinstall it with the README's CMAKE_ARGS"
    )
    assert g.ggml_cpu_has_llamafile(), (
        "ggml-python was built without tinyBLAS: reinstall it with the README's CMAKE_ARGS"
    )
    # tinyBLAS sums Q8_0 products as vec_dot does on x86: batches of Q8_0 rows take the GEMM
    assert probes.rows_independent(int(Q.Q8_0))
    assert not probes.rows_independent(int(Q.F32)) and not probes.rows_independent(int(Q.BF16))


def test_every_install_path_builds_the_same_kernels() -> None:
    """./setup (the README's and CI's install), the README's install by hand and the container build ggml with
    the flags the code names."""
    root = Path(__file__).resolve().parent.parent
    assert f'cmake_args="{ggml.GGML_CMAKE_ARGS}"' in (root / "setup").read_text()
    assert f'CMAKE_ARGS="{ggml.GGML_CMAKE_ARGS}"' in (root / "README.md").read_text()
    assert (
        f'ARG GGML_CMAKE_ARGS="{ggml.GGML_CMAKE_ARGS}"'
        in (root / "deploy/container/Dockerfile").read_text()
    )


def test_a_call_of_many_experts_fits_its_graph() -> None:
    """A node's call for 32 experts of the real layer shape (D 2048, F 512, Q4_K), 2 rows each: the graph's
    memory holds every tensor (ggml aborted the process here when it was sized for fewer), and each
    expert's rows are its FFN of them alone."""
    d, f = 2048, 512

    def matrix(rows: int, cols: int, seed: int) -> weights.Weight:
        raw = random_blocks(Q.Q4_K, rows * cols // 256, seed=seed)
        return weights.stored_weight(raw.reshape(-1), Q.Q4_K, (rows, cols), "native")

    ffns = [ffn.FFN(down=matrix(d, f, 3 * i), gate=matrix(f, d, 3 * i + 1), up=matrix(f, d, 3 * i + 2))
            for i in range(32)]  # fmt: skip
    x = torch.randn(64, d, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    ffn.ffn_rows([(fn, 2 * i, 2) for i, fn in enumerate(ffns)], x, out)
    for i in (0, 31):
        assert torch.equal(out[2 * i : 2 * i + 2], ffn.ffn(ffns[i], x[2 * i : 2 * i + 2]))


def test_a_prompt_graphs_intermediates_share_memory() -> None:
    """A one-off graph (a prompt's, more rows than are kept) of 12 ops in a chain over [512, 2048]: ggml's graph
    allocator gives an intermediate whose reader has run to the next, so the thread's buffer holds a few of
    them, not all twelve (48 MiB, which each prompt pass used to touch afresh), and the result is the chain's.
    The buffers are each thread's own and only grow: the graph runs on a thread of its own, so what earlier
    tests ran on this one does not count."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _prompt_graph_shares_memory()
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


def _prompt_graph_shares_memory() -> None:
    rows, cols, steps = 512, 2048, 12
    gr = graph.Graph(steps + 4)
    g = gr.g
    t = gr.input(cols, rows)
    for i in range(steps):
        t = g.ggml_silu(gr.ctx, t) if i % 2 == 0 else g.ggml_scale(gr.ctx, t, 1.5)
    gr.output(t)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    try:
        gr.build().run([x], [out])
    finally:
        gr.free()
    want = x.double()
    for i in range(steps):
        want = torch.nn.functional.silu(want) if i % 2 == 0 else want * 1.5
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-6)
    one = rows * cols * 4
    held = g.ggml_gallocr_get_buffer_size(graph._buffers.get_galloc(), 0)
    assert held <= 3 * one, f"the allocator holds {held / one:.1f} intermediates"
    assert graph._buffers.ctx_mem.nbytes < one  # the context holds the tensors' headers only


def test_one_off_graphs_of_the_same_size_but_other_wiring_each_get_their_own_layout() -> None:
    """Two one-off graphs in a row with as many nodes of the same sizes, wired differently: in the first each
    intermediate's only reader is the next op, so its memory passes on; in the second the first intermediate
    is read again at the end. Each gets its own result (ggml_gallocr_alloc_graph alone kept the first one's
    layout for the second, whose first intermediate was overwritten before its last reader ran)."""
    rows, cols = 512, 256
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))

    def run(wire: str) -> torch.Tensor:
        gr = graph.Graph(8)
        g, ctx = gr.g, gr.ctx
        t = gr.input(cols, rows)
        a = g.ggml_silu(ctx, t)
        c = g.ggml_silu(ctx, g.ggml_scale(ctx, a, 2.0))
        y = g.ggml_add(ctx, c, c if wire == "chain" else a)  # "late": a is read again here
        gr.output(y)
        out = torch.empty_like(x)
        try:
            gr.build().run([x], [out])
        finally:
            gr.free()
        return out

    silu = torch.nn.functional.silu
    torch.testing.assert_close(run("chain"), 2 * silu(2 * silu(x)))
    torch.testing.assert_close(run("late"), silu(2 * silu(x)) + silu(x))
