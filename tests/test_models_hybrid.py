"""qwen35moe and qwen3next (Gated DeltaNet + gated attention + MoE with shared expert) on the coordinator.

References are the fixtures' independent engines (tests/fixtures/README.md): transformers on the HF
checkpoint (or on the weights read back from a BF16/quantized GGUF: `hfdq_<q>`) and llama.cpp on the
GGUF (or on its exact dequantization: `llama_<q>_deq`). Tolerances are tests/reference.py's. The
expert backend is the in-process one over the file's own expert slabs.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from gguf import GGUFReader, GGUFWriter, Keys
from reference import assert_logits_close

from swarm.compute.store import ExpertStore
from swarm.coordinator.experts.backend import LocalExperts
from swarm.coordinator.loader import load_model
from swarm.coordinator.models.base import Checkpoint, DecoderModel, PackedEmbedding
from swarm.coordinator.models.deltanet import (
    DeltaNetState,
    GatedDeltaNet,
    gated_delta_chunked,
    gated_delta_recurrent,
)
from swarm.coordinator.models.hybrid import check_text_rope_sections
from swarm.coordinator.models.moe import MoE
from swarm.sharding.gguf_io import GGUFError, open_gguf, read_metadata, tensor_to_numpy
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import slabs_from_gguf, slabs_from_shard

N_PROMPTS = 4
N_GREEDY = 16
# Our own two ways of computing the same thing (chunked vs recurrent, batched vs alone) differ only by
# float32 rounding (~1e-5 on these logits); a real mistake moves logits by 1e-2 or more.
ATOL_SELF = 1e-4

# (fixture dir, GGUF file, reference prefixes to match, numerics). For BF16 / quantized files the
# references are the engines run on the exactly dequantized weights, as the fixtures' README prescribes:
# the exact numerics. (F32 files multiply the same float32 bytes in both numerics; the native numerics on
# the other files is judged against llama.cpp's own kernels in test_native.py.)
VARIANTS = {
    "qwen35moe-f32": ("qwen35moe-tiny", "model-f32.gguf", ("hf", "llama_f32"), "native"),
    "qwen3next-f32": ("qwen3next-tiny", "model-f32.gguf", ("hf", "llama_f32"), "native"),
    "qwen35moe-bf16": ("qwen35moe-tiny", "model-bf16.gguf", ("hfdq_bf16", "llama_bf16_deq"), "exact"),
    "qwen35moe-q8_0": ("qwen35moe-quant", "model-q8_0.gguf", ("hfdq_q8_0", "llama_q8_0_deq"), "exact"),
    "qwen35moe-q4_k_m": (
        "qwen35moe-quant",
        "model-q4_k_m.gguf",
        ("hfdq_q4_k_m", "llama_q4_k_m_deq"),
        "exact",
    ),
}


def load(path: Path, numerics: str = "native") -> DecoderModel:
    experts = LocalExperts(ExpertStore(slabs_from_gguf(path)), numerics=numerics)
    model, _ = load_model(path, experts, device="cpu", numerics=numerics)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[DecoderModel, Any, tuple[str, ...]]:
    d, f, refs, numerics = VARIANTS[request.param]
    return load(FIXTURES / d / f, numerics), np.load(FIXTURES / d / "reference.npz"), refs


def tokens(ref: Any, i: int) -> torch.Tensor:
    return torch.from_numpy(ref[f"tokens_{i}"].astype(np.int64))


def greedy(model: DecoderModel, prompt: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """Prefill, then n greedy tokens fed back one call each: (tokens, the n decode calls' logits)."""
    state = model.new_state()
    last = model.run(prompt, state)[-1]
    out, rows = [], []
    for _ in range(n):
        out.append(int(last.argmax()))
        last = model.run([out[-1]], state)[0]
        rows.append(last)
    return out, torch.stack(rows)


# --- against the references ------------------------------------------------------------------------


def test_prefill_logits_match_both_engines(variant: tuple[DecoderModel, Any, tuple[str, ...]]) -> None:
    model, ref, refs = variant
    for i in range(N_PROMPTS):
        logits = model.run(tokens(ref, i), model.new_state())
        for r in refs:
            assert_logits_close(logits, ref[f"{r}_logits_{i}"], f"prompt {i} vs {r}")


def test_greedy_decode_matches_both_engines(variant: tuple[DecoderModel, Any, tuple[str, ...]]) -> None:
    model, ref, refs = variant
    for i in range(N_PROMPTS):
        got, rows = greedy(model, tokens(ref, i), N_GREEDY)
        for r in refs:
            assert got == ref[f"{r}_greedy_{i}"].tolist(), f"prompt {i}: greedy tokens differ from {r}"
            assert_logits_close(rows, ref[f"{r}_greedy_logits_{i}"], f"prompt {i} decode vs {r}")


# --- our own forms agree with each other ------------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen35moe-tiny", "qwen3next-tiny"])
def f32_model(request: pytest.FixtureRequest) -> tuple[DecoderModel, Any]:
    return load(FIXTURES / request.param / "model-f32.gguf"), np.load(
        FIXTURES / request.param / "reference.npz"
    )


def test_prefill_then_decode_equals_one_token_at_a_time(f32_model: tuple[DecoderModel, Any]) -> None:
    model, ref = f32_model
    # 97 tokens: the first prefill call spans two 64-token chunks of the DeltaNet prefill form.
    toks = torch.cat([tokens(ref, i) for i in (1, 0, 2)])
    state = model.new_state()
    chunked = torch.cat([model.run(toks[:70], state), model.run(toks[70:], state)])
    state = model.new_state()
    stepped = torch.cat([model.run(toks[j : j + 1], state) for j in range(len(toks))])
    torch.testing.assert_close(chunked, stepped, rtol=0, atol=ATOL_SELF)
    # Both still agree with an independent engine's one-shot prefill where it has one.
    assert_logits_close(stepped[:40], ref["llama_f32_logits_1"], "token-at-a-time vs llama.cpp")


def test_batched_sequences_equal_each_alone(f32_model: tuple[DecoderModel, Any]) -> None:
    model, ref = f32_model
    a, b = tokens(ref, 0), tokens(ref, 2)
    alone_a = model.run(a, sa := model.new_state())
    alone_b = model.run(b, sb := model.new_state())
    step_a = model.run([7], sa)
    step_b = model.run([11], sb)

    s1, s2 = model.new_state(), model.new_state()
    both = model(torch.cat([a, b]), [s1, s2], [len(a), len(b)])
    torch.testing.assert_close(both[: len(a)], alone_a, rtol=0, atol=ATOL_SELF)
    torch.testing.assert_close(both[len(a) :], alone_b, rtol=0, atol=ATOL_SELF)
    # A decode step of both sequences in one call (the batched recurrent path).
    steps = model(torch.tensor([7, 11]), [s1, s2], [1, 1])
    torch.testing.assert_close(steps[0], step_a[0], rtol=0, atol=ATOL_SELF)
    torch.testing.assert_close(steps[1], step_b[0], rtol=0, atol=ATOL_SELF)
    # A prefill and a decode step mixed in one call.
    s3, s4 = model.new_state(), model.new_state()
    model.run(a, s3)
    mixed = model(torch.cat([torch.tensor([7]), b]), [s3, s4], [1, len(b)])
    torch.testing.assert_close(mixed[0], step_a[0], rtol=0, atol=ATOL_SELF)
    torch.testing.assert_close(mixed[1:], alone_b, rtol=0, atol=ATOL_SELF)


def test_decode_steps_update_the_recurrent_state_where_it_lies_and_checkpoints_keep_theirs(
    f32_model: tuple[DecoderModel, Any],
) -> None:
    """After the first decode step, each linear-attention layer's state is updated in its own buffer (no new
    one per step). A checkpoint copies nothing: it refers to the state where it lies, the steps after it
    write elsewhere, so going back to it gives the same logits; and with a checkpoint after every step
    (every answer checked, every pass settled) two buffers a layer take turns, none allocated again."""
    model, ref = f32_model
    state = model.new_state()
    model.run(tokens(ref, 0), state)
    model.run([7], state)
    ssm = [layer for layer in state.layers if isinstance(layer, DeltaNetState)]

    def where() -> list[int]:
        return [s.ssm.untyped_storage().data_ptr() for s in ssm]  # type: ignore[union-attr]

    before = where()
    model.run([9], state)
    assert where() == before  # no checkpoint: in place
    cp = state.checkpoint()
    kept = [layer[1].clone() for layer in cp.layers if isinstance(layer, tuple) and layer[1] is not None]
    assert [layer[1].untyped_storage().data_ptr() for layer in cp.layers if isinstance(layer, tuple)] == before
    first = torch.stack([model.run([t], state)[0] for t in (11, 13, 17)])
    moved = where()
    assert all(a != b for a, b in zip(moved, before, strict=True))  # not over the checkpoint's state
    got = [layer[1] for layer in cp.layers if isinstance(layer, tuple) and layer[1] is not None]
    assert all(torch.equal(a, b) for a, b in zip(got, kept, strict=True))
    state.restore(cp)
    again = torch.stack([model.run([t], state)[0] for t in (11, 13, 17)])
    assert torch.equal(first, again)
    seen: list[set[int]] = [set() for _ in ssm]
    for t in range(8):
        cp = state.checkpoint()  # (the one before is forgotten here)
        model.run([20 + t], state)
        if t >= 2:  # (the first steps leave the restored copy, which is no step's buffer)
            for found, at in zip(seen, where(), strict=True):
                found.add(at)
    assert all(len(found) == 2 for found in seen), seen


def test_one_graph_layers_give_the_op_by_op_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DeltaNet layer runs as one ggml graph where it can (kernels.delta_net_layer), and so does an
    in-process MoE layer (kernels.moe_layer: experts, shared expert, sum); otherwise they go op by op (the
    experts apart, as a node computes them, then kernels.moe_combine). On a quantized file in the native
    numerics, a prompt, decode steps and a call mixing a prompt with a decode step give the same bits
    either way."""
    model = load(FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf")
    ref = np.load(FIXTURES / "qwen35moe-quant" / "reference.npz")
    a, b = tokens(ref, 0), tokens(ref, 1)

    def run() -> list[torch.Tensor]:
        sa, sb = model.new_state(), model.new_state()
        out = [model.run(a, sa), model.run([5], sa)]
        out.append(model(torch.cat([torch.tensor([9]), b]), [sa, sb], [1, len(b)]))
        out.append(model(torch.tensor([3, 4]), [sa, sb], [1, 1]))
        return out

    ran: list[bool] = []
    for cls in (GatedDeltaNet, MoE):
        whole = cls._whole

        def counted(*args: Any, whole: Any = whole) -> torch.Tensor | None:
            y = whole(*args)
            ran.append(y is not None)
            return y

        monkeypatch.setattr(cls, "_whole", counted)
    fused = run()
    assert len(ran) == 4 * 7 and all(ran)  # every DeltaNet and MoE layer of every call took one graph
    for cls in (GatedDeltaNet, MoE):
        monkeypatch.setattr(cls, "_whole", lambda *args: None)
    for got, want in zip(fused, run(), strict=True):
        assert torch.equal(got, want)


def test_chunked_delta_rule_equals_recurrent() -> None:
    gen = torch.Generator().manual_seed(0)
    h, t, dk, dv = 3, 150, 16, 8  # several chunks and a partial one

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = torch.nn.functional.normalize(rnd(h, t, dk), dim=-1) / 4
    k = torch.nn.functional.normalize(rnd(h, t, dk), dim=-1)
    v, s0 = rnd(h, t, dv), rnd(h, dk, dv)
    g = -torch.rand(h, t, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(h, t, generator=gen, dtype=torch.float64)
    o_ref, s_ref = gated_delta_recurrent(q, k, v, g, beta, s0)
    for chunk in (64, 7, 1):
        o, s = gated_delta_chunked(q, k, v, g, beta, s0, chunk=chunk)
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(s, s_ref, rtol=0, atol=1e-12)


# --- file layouts ------------------------------------------------------------------------------------


def test_mtp_block_left_out_of_the_main_pass() -> None:
    path = FIXTURES / "qwen35moe-tiny" / "model-f32.gguf"
    meta = read_metadata(open_gguf(path))
    assert meta[Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch="qwen35moe")] == 1
    model = load(path)
    assert len(model.blk) == meta[Keys.LLM.BLOCK_COUNT.format(arch="qwen35moe")] - 1


def test_shard_directory_gives_the_same_logits(tmp_path: Path) -> None:
    """dense.gguf + slab files of `swarm shard` (MTP block included) run exactly like the whole file."""
    src = FIXTURES / "qwen35moe-tiny" / "model-f32.gguf"
    out = tmp_path / "shard"
    shard_model(src, out)
    slabs, problems = slabs_from_shard(out)
    assert problems == []
    sharded, _ = load_model(out, LocalExperts(ExpertStore(slabs)), device="cpu")
    whole = load(src)
    ref = np.load(FIXTURES / "qwen35moe-tiny" / "reference.npz")
    prompt = tokens(ref, 2)
    assert torch.equal(sharded.run(prompt, sharded.new_state()), whole.run(prompt, whole.new_state()))


def test_legacy_fused_ssm_in_layout(tmp_path: Path) -> None:
    """Older qwen3next files hold HF's in_proj_qkvz as ssm_in, per key head [q, k, v (r heads), z (r
    heads)], instead of attn_qkv + attn_gate: rebuild the fixture that way, expect the same logits."""
    src = FIXTURES / "qwen3next-tiny" / "model-f32.gguf"
    meta = read_metadata(open_gguf(src))
    hk, hv, ds = (meta[f"qwen3next.ssm.{k}"] for k in ("group_count", "time_step_rank", "state_size"))
    r = hv // hk
    reader = GGUFReader(src)
    dst = tmp_path / "legacy.gguf"
    writer = GGUFWriter(dst, "qwen3next")
    copy_metadata(reader, writer)
    arrays = {t.name: tensor_to_numpy(t) for t in reader.tensors}
    for name, arr in arrays.items():
        if name.endswith(".attn_gate.weight"):
            continue
        if name.endswith(".attn_qkv.weight"):
            z = arrays[name.replace("attn_qkv", "attn_gate")]  # [Hv*Dv, D]
            q, k, v = np.split(arr, [hk * ds, 2 * hk * ds])
            per_head = [
                np.concatenate([q[i * ds : (i + 1) * ds], k[i * ds : (i + 1) * ds], v_i, z_i])
                for i, v_i, z_i in zip(range(hk), np.split(v, hk), np.split(z, hk), strict=True)
            ]
            assert per_head[0].shape[0] == 2 * ds + 2 * r * ds
            writer.add_tensor(name.replace("attn_qkv", "ssm_in"), np.concatenate(per_head))
        else:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref = np.load(FIXTURES / "qwen3next-tiny" / "reference.npz")
    model = load(dst)
    assert_logits_close(model.run(tokens(ref, 0), model.new_state()), ref["hf_logits_0"], "legacy ssm_in")


def copy_metadata(reader: GGUFReader, writer: GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == Keys.General.ARCHITECTURE:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), value_type, sub_type=sub_type)


def test_rope_sections_must_cover_every_rotary_pair() -> None:
    check_text_rope_sections([11, 11, 10, 0], 64)  # Qwen3.5/3.6: head_dim 256, 64 rotated dims
    check_text_rope_sections([3, 3, 2, 0], 16)  # the fixture
    with pytest.raises(GGUFError, match="falls outside"):
        check_text_rope_sections([2, 2, 2, 2], 16)  # pairs in the 4th (non-text) section
    with pytest.raises(GGUFError, match="falls outside"):
        check_text_rope_sections([3, 3, 1, 0], 16)


@pytest.mark.parametrize(
    ("model_dir", "file"),
    [
        ("qwen35moe-quant", "model-q4_k_m.gguf"),
        ("qwen35moe-quant", "model-q8_0.gguf"),
        ("qwen35moe-tiny", "model-bf16.gguf"),
    ],
)
def test_a_non_float32_token_table_stays_packed_and_looks_up_gguf_values(model_dir: str, file: str) -> None:
    """Only the looked-up rows are decoded, and they are exactly gguf-py's dequantization of the table."""
    path = FIXTURES / model_dir / file
    model, _ = load_model(path, LocalExperts(ExpertStore({})), device="cpu")
    assert isinstance(model.token_embd, PackedEmbedding)
    assert "token_embd.weight" not in model.state_dict()
    table = next(t for t in open_gguf(path).tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(tensor_to_numpy(table))  # [V, D], gguf-py's numpy dequantizer
    ids = torch.tensor([0, 5, 5, expected.shape[0] - 1, 17])
    assert torch.equal(model.token_embd(ids), expected[ids])


def test_a_float32_token_table_stays_in_the_file_too() -> None:
    """Even a float32 table is looked up in the file's memory map: no copy of the vocabulary."""
    path = FIXTURES / "qwen35moe-tiny" / "model-f32.gguf"
    model, _ = load_model(path, LocalExperts(ExpertStore({})), device="cpu")
    assert isinstance(model.token_embd, PackedEmbedding)
    table = next(t for t in open_gguf(path).tensors if t.name == "token_embd.weight")
    ids = torch.tensor([3, 0, 700])
    assert torch.equal(model.token_embd(ids), torch.from_numpy(np.array(table.data))[ids])


def _same_checkpoint(a: Checkpoint, b: Checkpoint) -> bool:
    """Two SequenceState checkpoints hold the same position and the same bits in every layer."""
    if (a.length, a.position) != (b.length, b.position):
        return False
    for x, y in zip(a.layers, b.layers, strict=True):
        pairs = zip(x, y, strict=True) if isinstance(x, tuple) else [(x, y)]
        if not all(torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in pairs):
            return False
    return True


@pytest.mark.parametrize(
    ("fixture", "lengths", "marks"),
    [
        ("qwen35moe-quant/model-q4_k_m.gguf", (40, 11), ((30,), ())),  # a layer in one graph
        ("qwen35moe-quant/model-q4_k_m.gguf", (10, 3, 2), ((4,), (), (1,))),  # ... a kept one (few rows)
        ("qwen3next-tiny/model-f32.gguf", (40, 11), ((30,), (5,))),  # op by op (fused ssm_ba)
        ("qwen35moe-tiny/model-f32.gguf", (300,), ((270,),)),  # over RECURRENT_MAX: the chunked form
        # checking windows (a mark after every row but the last) beside a decode step and a prompt chunk
        ("qwen35moe-quant/model-q4_k_m.gguf", (4, 1, 3, 9), ((1, 2, 3), (), (1, 2), (2, 7))),
        ("qwen3next-tiny/model-f32.gguf", (4, 1, 3), ((1, 2, 3), (), (1, 2))),
    ],
)
def test_marks_keep_the_checkpoints_of_reading_the_tokens_in_separate_calls(
    fixture: str, lengths: tuple[int, ...], marks: tuple[tuple[int, ...], ...]
) -> None:
    """A pass with marks (what the serve scheduler asks for a few tokens before a prompt's end; a checking
    window after each of its rows) leaves the checkpoints that reading the tokens up to each mark,
    checkpointing, then reading on would, bit for bit, and the same logits and final state; each
    checkpoint, restored, reads the rest to the same logits again."""
    model = load(FIXTURES / fixture)
    g = torch.Generator().manual_seed(sum(lengths))
    seqs = [torch.randint(3, 700, (n,), generator=g) for n in lengths]
    apart, cps, logits = [], [], []
    for s, ms in zip(seqs, marks, strict=True):
        st = model.new_state()
        rows, mine = [], []
        for a, b in itertools.pairwise([0, *ms, len(s)]):
            if a:
                mine.append(st.checkpoint())
            rows.append(model.run(s[a:b], st))
        cps.append(mine)
        apart.append(st)
        logits.append(torch.cat(rows))
    states = [model.new_state() for _ in seqs]
    together = model(torch.cat(seqs), states, list(lengths), marks=list(marks))
    assert torch.equal(together, torch.cat(logits))
    for st, ref, mine, ms, s, rows in zip(states, apart, cps, marks, seqs, logits, strict=True):
        assert _same_checkpoint(st.checkpoint(), ref.checkpoint())
        assert len(st.marked) == len(ms)
        for cp, m, want in zip(st.marked, ms, mine, strict=True):
            assert cp.length == m and _same_checkpoint(cp, want)
        for cp in st.marked:
            st.restore(cp)
            assert torch.equal(model.run(s[cp.length :], st), rows[cp.length :])


def test_tails_give_the_last_rows_of_each_sequence() -> None:
    """`tails` picks each sequence's last rows of logits, the rows of all of them (a checking window beside
    a prompt chunk whose last row alone is wanted)."""
    model = load(FIXTURES / "qwen35moe-quant/model-q4_k_m.gguf")
    ids = torch.randint(3, 700, (9,), generator=torch.Generator().manual_seed(3))
    every = model(ids, [model.new_state(), model.new_state()], [5, 4])
    some = model(ids, [model.new_state(), model.new_state()], [5, 4], tails=[1, 3])
    assert torch.equal(some, every[[4, 6, 7, 8]])
    with pytest.raises(ValueError, match="tails"):
        model(ids, [model.new_state(), model.new_state()], [5, 4], tails=[1, 5])
