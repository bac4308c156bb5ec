"""qwen3moe and qwen2moe on the coordinator, against the fixtures' transformers and llama.cpp logits.

The expert backend is the in-process one over the fixture's own expert slabs. References are
independent engines (tests/fixtures/README.md); tolerances are tests/reference.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES
from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys
from reference import assert_logits_close

from swarm.compute.store import ExpertStore
from swarm.coordinator.experts.backend import LocalExperts
from swarm.coordinator.loader import load_model
from swarm.coordinator.models import ARCHS
from swarm.coordinator.models.attention import attention, rope
from swarm.coordinator.models.base import DecoderModel
from swarm.coordinator.models.moe import FEW_ROWS, route
from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import GGUFError, open_gguf
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import slabs_from_gguf, slabs_from_shard

ARCH_NAMES = ["qwen3moe", "qwen2moe"]
N_PROMPTS = 4
N_GREEDY = 16


def gguf_of(arch: str) -> Path:
    return FIXTURES / f"{arch}-tiny" / "model-f32.gguf"


def local_experts(path: Path) -> LocalExperts:
    return LocalExperts(ExpertStore(slabs_from_gguf(path)))


@pytest.fixture(scope="module", params=ARCH_NAMES)
def loaded(request: pytest.FixtureRequest) -> tuple[str, DecoderModel, Any]:
    arch = request.param
    model, meta = load_model(gguf_of(arch), local_experts(gguf_of(arch)), device="cpu")
    assert meta[Keys.General.ARCHITECTURE] == arch
    return arch, model, np.load(FIXTURES / f"{arch}-tiny" / "reference.npz")


def tokens(ref: Any, i: int) -> torch.Tensor:
    return torch.from_numpy(ref[f"tokens_{i}"].astype(np.int64))


# --- forward against the references ---------------------------------------------------------------


def test_prefill_logits_match_both_engines(loaded: tuple[str, DecoderModel, Any]) -> None:
    arch, model, ref = loaded
    for i in range(N_PROMPTS):
        logits = model.run(tokens(ref, i), model.new_state())
        assert logits.dtype == torch.float32 and not logits.is_inference()  # callers may edit it in place
        for engine in ("hf", "llama_f32"):
            assert_logits_close(logits, ref[f"{engine}_logits_{i}"], f"{arch} prompt {i} vs {engine}")


def test_greedy_decode_through_kv_cache(loaded: tuple[str, DecoderModel, Any]) -> None:
    arch, model, ref = loaded
    for i in range(N_PROMPTS):
        state = model.new_state()
        token = int(model.run(tokens(ref, i), state)[-1].argmax())
        greedy, rows = [], []
        for _ in range(N_GREEDY):
            greedy.append(token)
            row = model.run([token], state)  # [1, V]: one new token against the cache
            rows.append(row[0])
            token = int(row[0].argmax())
        assert state.length == len(ref[f"tokens_{i}"]) + N_GREEDY
        decode_logits = torch.stack(rows)
        for engine in ("hf", "llama_f32"):
            assert greedy == ref[f"{engine}_greedy_{i}"].tolist(), f"{arch} prompt {i}: greedy vs {engine}"
            assert_logits_close(
                decode_logits, ref[f"{engine}_greedy_logits_{i}"], f"{arch} prompt {i} decode vs {engine}"
            )


def test_prefill_then_decode_equals_token_by_token(loaded: tuple[str, DecoderModel, Any]) -> None:
    arch, model, ref = loaded
    ids = tokens(ref, 0)
    whole = model.run(ids, model.new_state())

    state = model.new_state()
    split = [model.run(ids[:9], state), *(model.run(ids[t : t + 1], state) for t in range(9, len(ids)))]
    state = model.new_state()
    one_by_one = torch.cat([model.run(ids[t : t + 1], state) for t in range(len(ids))])

    for name, logits in (("prefill 9 then decode", torch.cat(split)), ("one token at a time", one_by_one)):
        assert_logits_close(logits, ref["hf_logits_0"], f"{arch} {name} vs hf")
        # Same model, same weights: only the order of float sums differs.
        torch.testing.assert_close(logits, whole, rtol=0, atol=1e-4)


def test_batched_sequences_equal_each_alone(loaded: tuple[str, DecoderModel, Any]) -> None:
    arch, model, ref = loaded
    a, b = tokens(ref, 0), tokens(ref, 3)
    alone_a = model.run(a, model.new_state())
    alone_b = model.run(b, model.new_state())

    sa, sb = model.new_state(), model.new_state()
    both = model(torch.cat([a, b]), [sa, sb], [len(a), len(b)])  # one call, one fan-out per layer
    got_a, got_b = both[: len(a)], both[len(a) :]
    torch.testing.assert_close(got_a, alone_a, rtol=0, atol=1e-4)
    torch.testing.assert_close(got_b, alone_b, rtol=0, atol=1e-4)
    assert (sa.length, sb.length) == (len(a), len(b))

    # Then a mixed step, as `swarm serve` runs one: sequence a decodes its first greedy token while
    # a fresh sequence c prefills prompt 2. Each against the references.
    c = tokens(ref, 2)
    sc = model.new_state()
    g0 = int(ref["hf_greedy_0"][0])
    step = model(torch.cat([torch.tensor([g0]), c]), [sa, sc], [1, len(c)])
    assert_logits_close(step[:1], ref["hf_greedy_logits_0"][:1], f"{arch} batched decode of a vs hf")
    assert_logits_close(step[1:], ref["hf_logits_2"], f"{arch} batched prefill of c vs hf")

    last = model(torch.cat([a, b]), [model.new_state(), model.new_state()], [len(a), len(b)], last_only=True)
    torch.testing.assert_close(last, torch.stack([alone_a[-1], alone_b[-1]]), rtol=0, atol=1e-4)


class RecordingExperts:
    """Wraps a backend and records every call: (layer, rows)."""

    def __init__(self, inner: LocalExperts) -> None:
        self.inner = inner
        self.calls: list[tuple[int, int]] = []

    def stack(self, layer: int, ids: torch.Tensor) -> None:
        return None  # every layer goes through start(), which records it

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor) -> Any:
        self.calls.append((layer, x.shape[0]))
        return self.inner.start(layer, x, ids)


def test_one_expert_fan_out_per_layer_for_the_whole_batch(loaded: tuple[str, DecoderModel, Any]) -> None:
    arch, model, ref = loaded
    original = model.blk[0].moe.experts
    recorder = RecordingExperts(original)
    model.set_experts(recorder)
    try:
        a, b = tokens(ref, 0), tokens(ref, 3)
        model(torch.cat([a, b]), [model.new_state(), model.new_state()], [len(a), len(b)])
    finally:
        model.set_experts(original)
    assert recorder.calls == [(layer, len(a) + len(b)) for layer in range(len(model.blk))]


# --- layers against direct formulas ---------------------------------------------------------------


def test_rope_partial_neox_pairs_i_with_i_plus_half() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 100, 4095])
    out = rope(x, pos, n_rot=4, base=10000.0)
    torch.testing.assert_close(out[..., 4:], x[..., 4:], rtol=0, atol=0)  # unrotated dims pass through
    for i, theta_i in ((0, 1.0), (1, 10000.0 ** (-2 / 4))):
        ang = pos.double()[:, None] * theta_i
        c, s = ang.cos(), ang.sin()
        torch.testing.assert_close(out[..., i], x[..., i] * c - x[..., i + 2] * s)
        torch.testing.assert_close(out[..., i + 2], x[..., i + 2] * c + x[..., i] * s)


def test_router_ties_go_to_the_lower_expert_index_in_the_order_of_a_stable_sort() -> None:
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(64, 32, generator=g), dim=-1)
    # Ties at the K-th place, inside the top K, and a row of one value everywhere.
    probs[1, [3, 9, 20]] = probs[1].max() + 1.0
    probs[2, [30, 4]] = 0.9
    probs[2, 7] = 0.95
    probs[3] = 1.0 / 32
    probs[4, [5, 6]] = float("nan")
    for k in (1, 4, 8, 32):
        weights, ids = route(probs, k, renormalize=False)
        want = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ids, want), k
        torch.testing.assert_close(weights, probs.gather(-1, want), rtol=0, atol=0, equal_nan=True)
    _, ids = route(probs, 2, renormalize=True)
    assert ids[1].tolist() == [3, 9] and ids[2].tolist() == [7, 4] and ids[3].tolist() == [0, 1]


def test_router_gives_a_few_rows_the_bits_and_order_of_a_whole_batch() -> None:
    """A decode step's rows (numpy's stable sort) and a prompt's (torch's topk) choose the same experts in the
    same order with the same weights, ties and renormalization included; a row with a NaN takes the general
    path whatever its batch."""
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(40, 64, generator=g) * 3, dim=-1)
    probs[1, [3, 9, 20]] = probs[1].max() + 1.0
    probs[2, [30, 4]] = 0.9
    probs[3] = 1.0 / 64
    probs[5, [7, 8]] = probs[5, 11].item()  # ties below the top
    probs[6, 2] = 0.0
    probs[7, [5, 6]] = float("nan")
    assert probs.shape[0] > FEW_ROWS  # the whole batch takes the general path
    for k in (1, 4, 8):
        for renormalize in (False, True):
            w_all, i_all = route(probs, k, renormalize)
            for start in range(0, probs.shape[0], 3):
                w, i = route(probs[start : start + 3], k, renormalize)
                assert w.dtype == w_all.dtype and i.dtype == i_all.dtype
                assert torch.equal(i, i_all[start : start + 3]), (k, renormalize, start)
                assert torch.equal(w.view(torch.int32), w_all[start : start + 3].view(torch.int32)), (k, start)


def test_attention_is_causal_gqa_with_cache_offset() -> None:
    torch.manual_seed(0)
    h, hkv, s, t, hd = 4, 2, 6, 3, 8
    q = torch.randn(h, t, hd, dtype=torch.float64)
    k = torch.randn(hkv, s, hd, dtype=torch.float64)
    v = torch.randn(hkv, s, hd, dtype=torch.float64)
    out = attention(q, k, v)
    for head in range(h):
        kv = head // (h // hkv)
        for qi in range(t):
            seen = s - t + qi + 1
            w = torch.softmax(k[kv, :seen] @ q[head, qi] / hd**0.5, dim=0)
            torch.testing.assert_close(out[head, qi], w @ v[kv, :seen])


# --- the loader: shard dirs, MTP blocks, bad files ------------------------------------------------


def rewrite_gguf(
    src: Path,
    dst: Path,
    keep: Callable[[str], bool] = lambda name: True,
    meta: dict[str, tuple[Any, GGUFValueType]] | None = None,
    extra: dict[str, np.ndarray] | None = None,
    drop_keys: frozenset[str] = frozenset(),
) -> None:
    """Copy a GGUF with some tensors dropped, metadata keys dropped, replaced or added, tensors added."""
    reader = GGUFReader(src)
    meta = dict(meta or {})
    arch_key = Keys.General.ARCHITECTURE
    arch = meta.pop(arch_key, None)
    writer = GGUFWriter(dst, arch[0] if arch else reader.fields[arch_key].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == arch_key or key in meta or key in drop_keys:
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for key, (value, vtype) in meta.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if keep(t.name):
            writer.add_tensor(t.name, np.array(t.data))
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_swarm_shard_directory_loads(arch: str, tmp_path: Path) -> None:
    """`swarm shard` output: the model from DIR/dense.gguf, the experts from the slab files."""
    shard_model(gguf_of(arch), tmp_path)
    slabs, problems = slabs_from_shard(tmp_path)
    assert not problems
    model, meta = load_model(tmp_path, LocalExperts(ExpertStore(slabs)), device="cpu")
    assert meta[Keys.General.ARCHITECTURE] == arch
    ref = np.load(FIXTURES / f"{arch}-tiny" / "reference.npz")
    for i in (0, 3):
        logits = model.run(tokens(ref, i), model.new_state())
        assert_logits_close(logits, ref[f"llama_f32_logits_{i}"], f"{arch} shard dir, prompt {i}")


def test_mtp_block_is_left_out_of_the_main_pass(tmp_path: Path) -> None:
    """A file with one MTP block (block_count 5, nextn_predict_layers 1) runs blocks 0..3 only."""
    src = gguf_of("qwen3moe")
    reader = open_gguf(src)
    mtp = {
        t.name.replace("blk.3.", "blk.4.", 1): np.array(t.data)
        for t in reader.tensors
        if t.name.startswith("blk.3.")
    }
    mtp["blk.4.nextn.eh_proj.weight"] = np.zeros((64, 128), dtype=np.float32)
    mtp["blk.4.nextn.enorm.weight"] = np.ones(64, dtype=np.float32)
    meta = {
        Keys.LLM.BLOCK_COUNT.format(arch="qwen3moe"): (5, GGUFValueType.UINT32),
        Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch="qwen3moe"): (1, GGUFValueType.UINT32),
    }
    rewrite_gguf(src, tmp_path / "mtp.gguf", meta=meta, extra=mtp)
    model, _ = load_model(tmp_path / "mtp.gguf", local_experts(src), device="cpu")
    assert len(model.blk) == 4
    ref = np.load(FIXTURES / "qwen3moe-tiny" / "reference.npz")
    assert_logits_close(model.run(tokens(ref, 3), model.new_state()), ref["hf_logits_3"], "with MTP block")


def test_without_output_matrix_the_head_reuses_token_embd(tmp_path: Path) -> None:
    src = gguf_of("qwen3moe")
    tied = tmp_path / "tied.gguf"
    rewrite_gguf(src, tied, keep=lambda n: n != "output.weight")
    model, _ = load_model(tied, local_experts(src), device="cpu")
    embd = next(t for t in GGUFReader(src).tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(np.array(embd.data, dtype=np.float32))
    assert torch.equal(model.output.matrix.dense(), expected)  # the very bytes of token_embd
    tied_embd = next(t for t in open_gguf(tied).tensors if t.name == "token_embd.weight")
    assert model.output.matrix.weight.ptr == tied_embd.data.ctypes.data
    assert torch.equal(model.token_embd(torch.arange(expected.shape[0])), expected)


def test_older_qwen2moe_file_without_shared_width_uses_feed_forward_length(tmp_path: Path) -> None:
    """As llama.cpp does: no expert_shared_feed_forward_length -> the shared expert is feed_forward_length wide."""
    src = gguf_of("qwen2moe")
    old = tmp_path / "old.gguf"
    rewrite_gguf(
        src, old, drop_keys=frozenset({Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH.format(arch="qwen2moe")})
    )
    model, _ = load_model(old, local_experts(src), device="cpu")
    ref = np.load(FIXTURES / "qwen2moe-tiny" / "reference.npz")
    assert_logits_close(
        model.run(tokens(ref, 3), model.new_state()), ref["hf_logits_3"], "older qwen2moe file"
    )


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    src = gguf_of("qwen2moe")
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(src, bad, keep=lambda n: n != "blk.2.attn_k.bias")
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor blk\.2\.attn_k\.bias is missing"):
        load_model(bad, local_experts(src), device="cpu")


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    src = gguf_of("qwen3moe")
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(src, bad, extra={"blk.1.attn_bogus.weight": np.zeros(4, dtype=np.float32)})
    with pytest.raises(GGUFError, match=r"unexpected tensor blk\.1\.attn_bogus\.weight"):
        load_model(bad, local_experts(src), device="cpu")


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    src = gguf_of("qwen3moe")
    bad = tmp_path / "bad.gguf"
    meta = {Keys.Attention.HEAD_COUNT_KV.format(arch="qwen3moe"): (4, GGUFValueType.UINT32)}
    rewrite_gguf(src, bad, meta=meta)
    with pytest.raises(
        GGUFError, match=r"tensor blk\.0\.attn_k\.weight has shape \[64, 64\].*expects \[128, 64\]"
    ):
        load_model(bad, local_experts(src), device="cpu")


def test_missing_metadata_key_is_named(tmp_path: Path) -> None:
    src = gguf_of("qwen3moe")
    bad = tmp_path / "bad.gguf"
    key = Keys.LLM.EXPERT_USED_COUNT.format(arch="qwen3moe")
    rewrite_gguf(src, bad, drop_keys=frozenset({key}))
    with pytest.raises(GGUFError, match=rf"bad\.gguf: has no metadata key {key}"):
        load_model(bad, local_experts(src), device="cpu")


def test_unknown_arch_lists_the_supported_ones(tmp_path: Path) -> None:
    src = gguf_of("qwen3moe")
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(src, bad, meta={Keys.General.ARCHITECTURE: ("llama4", GGUFValueType.STRING)})
    with pytest.raises(UserError, match="'llama4' is not supported") as e:
        load_model(bad, local_experts(src), device="cpu")
    for name in ARCHS:
        assert name in str(e.value)


def test_directory_without_dense_gguf(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="without dense.gguf"):
        load_model(tmp_path, local_experts(gguf_of("qwen3moe")), device="cpu")
