"""`swarm synth`: layouts checked against the converter's own files (the fixtures), values against gguf's dequantizer."""

from __future__ import annotations

import filecmp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from gguf.quants import dequantize

from swarm.coordinator.cli import main
from swarm.sharding.errors import UserError
from swarm.sharding.gguf_io import expert_tensors, open_gguf, read_metadata
from swarm.sharding.synth import build_vocab, synthesize
from swarm.sharding.synth_mix import MIXES, mix_type
from swarm.sharding.synth_spec import EXPERT_TYPES, SynthSpec, preset

FIXTURES = Path(__file__).parent / "fixtures"

# (fixture GGUF, the type of its expert tensors, the type of its other matrices)
CONVERTED = [
    ("qwen35moe-tiny/model-f32.gguf", "F32", "F32"),
    ("qwen35moe-tiny/model-bf16.gguf", "BF16", "BF16"),
    ("qwen35moe-quant/model-q8_0.gguf", "Q8_0", "Q8_0"),
    # llama-quantize's Q4_K_M: every tensor's type as its mixture gives it (swarm.sharding.synth_mix)
    ("qwen35moe-quant/model-q4_k_m.gguf", "Q4_K_M", "Q4_K_M"),
    ("qwen3next-tiny/model-f32.gguf", "F32", "F32"),
    ("qwen2moe-tiny/model-f32.gguf", "F32", "F32"),
    ("qwen3moe-tiny/model-f32.gguf", "F32", "F32"),
]


def spec_like(meta: dict[str, Any], experts_type: str, dense_type: str) -> SynthSpec:
    """The SynthSpec with a fixture's dimensions, read from the fixture's own metadata."""
    arch = meta["general.architecture"]

    def get(key: str, default: Any = 0) -> Any:
        return meta.get(f"{arch}.{key}", default)

    mtp = get("nextn_predict_layers")
    return SynthSpec(
        arch=arch,
        n_layers=get("block_count") - mtp,
        n_embd=get("embedding_length"),
        n_expert=get("expert_count"),
        n_expert_used=get("expert_used_count"),
        expert_ff=get("expert_feed_forward_length"),
        shared_ff=get("expert_shared_feed_forward_length"),
        ff=get("feed_forward_length"),
        n_head=get("attention.head_count"),
        n_head_kv=get("attention.head_count_kv"),
        head_dim=get("attention.key_length") or get("embedding_length") // get("attention.head_count"),
        ssm_k_heads=get("ssm.group_count", 1),
        ssm_v_heads=get("ssm.time_step_rank", 1),
        ssm_head_dim=get("ssm.state_size", 1),
        conv_kernel=get("ssm.conv_kernel", 4),
        rope_dim=get("rope.dimension_count"),
        rope_sections=tuple(get("rope.dimension_sections", ())),
        rope_base=get("rope.freq_base"),
        context_length=get("context_length"),
        n_vocab=len(meta["tokenizer.ggml.tokens"]),
        experts_type=experts_type,
        dense_type=dense_type,
        mtp=mtp,
    )


def fields(reader: GGUFReader) -> dict[str, list[Any]]:
    return {k: f.types for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize(("fixture", "experts_type", "dense_type"), CONVERTED)
def test_layout_matches_converted_fixture(tmp_path, fixture, experts_type, dense_type):
    ref = open_gguf(FIXTURES / fixture)
    ref_meta = read_metadata(ref)
    out = synthesize(tmp_path / "s.gguf", spec_like(ref_meta, experts_type, dense_type))
    got = open_gguf(out)
    got_meta = read_metadata(got)

    # The same keys with the same value types; in the same order where the converter wrote the file
    # (llama-quantize moves general.file_type to the end).
    assert fields(got) == fields(ref)
    if "quant" not in fixture:
        assert list(fields(got)) == list(fields(ref))
    # Every hyper-parameter equal (the vocabulary is our own BPE, and the name says the file is synthetic).
    own = ("general.name", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    own += ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id")
    for key, value in ref_meta.items():
        if key not in own:
            assert got_meta[key] == pytest.approx(value), key

    ref_tensors = [(t.name, t.shape.tolist(), t.tensor_type) for t in ref.tensors]
    got_tensors = [(t.name, t.shape.tolist(), t.tensor_type) for t in got.tensors]
    if fixture.startswith("qwen35moe-quant"):
        # That file (converted separately) stores ffn_gate_inp_shexp as {D}; the tiny ones as {D, 1}, like us.
        # llama.cpp accepts both. Everything else must agree exactly.
        ref_tensors = [
            (n, s + [1] if n.endswith("gate_inp_shexp.weight") else s, q) for n, s, q in ref_tensors
        ]
    if ref.tensors[0].name == "output.weight" and ref.tensors[1].name != "token_embd.weight":
        ref_tensors.sort()  # llama-quantize's output order; we write the converter's
        got_tensors.sort()
    assert got_tensors == ref_tensors


@pytest.mark.parametrize(
    ("name", "fixture", "mtp"),
    [
        ("qwen35moe-tiny", "qwen35moe-tiny/model-f32.gguf", 1),
        ("qwen35moe-tiny", "qwen35moe-quant/model-q8_0.gguf", 0),
        ("qwen3next-tiny", "qwen3next-tiny/model-f32.gguf", 0),
        ("qwen2moe-tiny", "qwen2moe-tiny/model-f32.gguf", 0),
        ("qwen3moe-tiny", "qwen3moe-tiny/model-f32.gguf", 0),
    ],
)
def test_tiny_presets_have_the_fixture_names_and_keys(tmp_path, name, fixture, mtp):
    ref = GGUFReader(FIXTURES / fixture)
    got = GGUFReader(synthesize(tmp_path / "s.gguf", preset(name, mtp=mtp)))
    assert sorted(fields(got)) == sorted(fields(ref))
    got_names = [t.name for t in got.tensors]
    assert sorted(got_names) == sorted(t.name for t in ref.tensors)
    # Shapes follow the dims: every expert tensor is {row, col, E} with E the expert count.
    meta = read_metadata(got)
    arch = meta["general.architecture"]
    e = meta[f"{arch}.expert_count"]
    d = meta[f"{arch}.embedding_length"]
    f = meta[f"{arch}.expert_feed_forward_length"]
    for t in got.tensors:
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            assert t.shape.tolist() == [d, f, e]
        if t.name.endswith("ffn_down_exps.weight"):
            assert t.shape.tolist() == [f, d, e]


def test_converter_keeps_these_f32(tmp_path):
    got = GGUFReader(synthesize(tmp_path / "s.gguf", preset("qwen35moe-tiny", dense_type="Q8_0", mtp=1)))
    f32 = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_a", "ssm_dt.bias")
    f32 += ("ssm_conv1d.weight", "nextn.enorm.weight", "nextn.hnorm.weight")
    for t in got.tensors:
        if t.name.endswith(f32):
            assert t.tensor_type == GGMLQuantizationType.F32, t.name
        elif "_exps." in t.name:
            assert t.tensor_type == GGMLQuantizationType.Q4_K, t.name
        else:
            assert t.tensor_type == GGMLQuantizationType.Q8_0, t.name
    ssm_a = [t for t in got.tensors if t.name.endswith("ssm_a")]
    assert ssm_a and all((np.asarray(t.data) < 0).all() for t in ssm_a)


@pytest.mark.parametrize("qtype", EXPERT_TYPES)
def test_every_expert_type_dequantizes_to_sane_values(tmp_path, qtype):
    spec = preset("qwen3moe-tiny", n_layers=1, experts_type=qtype, n_vocab=300)
    path = synthesize(tmp_path / "s.gguf", spec)
    reader = open_gguf(path)
    found = expert_tensors(reader, path)
    assert {x.kind for x in found} == {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    for x in found:
        # a mixture's type is its own per tensor (Q4_K_M: Q4_K, ffn_down Q6_K in its chosen layers)
        mixed = qtype in MIXES
        assert x.qtype == (
            mix_type(qtype, x.name, x.tensor.shape.tolist(), 1, spec.n_expert)
            if mixed
            else GGMLQuantizationType[qtype]
        )
        assert x.n_expert == spec.n_expert
        assert x.slab_bytes * x.n_expert == x.tensor.n_bytes
        raw = np.asarray(x.tensor.data).view(np.uint8).reshape(-1)
        rows = spec.n_expert * x.slab_shape[0]
        values = dequantize(raw.reshape(rows, -1), x.qtype)
        fan_in = x.slab_shape[1]
        assert np.isfinite(values).all()
        # N(0, 1/fan_in) intended; quantized random blocks must land near it, not at 0 or 1e4.
        assert values.std() == pytest.approx(fan_in**-0.5, rel=0.25)
        assert abs(values.mean()) < 0.1 * fan_in**-0.5
        # Not one repeated block: the experts differ.
        assert not np.array_equal(x.slab(0), x.slab(1))


def test_35b_layer_shape_slab_size(tmp_path):
    # The real 35B-A3B expert shape (D 2048, F 512), with 8 of its 256 experts to keep the test small.
    spec = preset("qwen3.6-35b-a3b", n_layers=1, n_expert=8, n_vocab=512)
    path = synthesize(tmp_path / "s.gguf", spec)
    found = {x.kind: x for x in expert_tensors(open_gguf(path), path)}
    assert found["ffn_gate_exps"].slab_bytes == 2048 * 512 // 256 * 144
    assert found["ffn_up_exps"].slab_bytes == 2048 * 512 // 256 * 144
    assert found["ffn_down_exps"].slab_bytes == 512 * 2048 // 256 * 144
    assert found["ffn_down_exps"].slab_shape == (2048, 512)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = synthesize(tmp_path / "a.gguf", preset("qwen3next-tiny", n_layers=2, seed=7))
    build_vocab.cache_clear()  # train the tokenizer again, as a fresh process would
    b = synthesize(tmp_path / "b.gguf", preset("qwen3next-tiny", n_layers=2, seed=7))
    c = synthesize(tmp_path / "c.gguf", preset("qwen3next-tiny", n_layers=2, seed=8))
    assert filecmp.cmp(a, b, shallow=False)
    assert not filecmp.cmp(a, c, shallow=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf"]  # no temp files left


def test_tokenizer_metadata_is_a_working_byte_level_bpe(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    ref = read_metadata(GGUFReader(FIXTURES / "qwen35moe-tiny/model-f32.gguf"))
    meta = read_metadata(GGUFReader(synthesize(tmp_path / "s.gguf", preset("qwen35moe-tiny", n_vocab=1000))))
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 1000
    assert tokens[:256] == ref["tokenizer.ggml.tokens"][:256]  # the same byte alphabet, same order
    assert meta["tokenizer.chat_template"] == ref["tokenizer.chat_template"]
    assert meta["tokenizer.ggml.pre"] == "qwen35"
    by_text = {t: i for i, t in enumerate(tokens)}
    assert meta["tokenizer.ggml.eos_token_id"] == by_text["<|im_end|>"]
    assert meta["tokenizer.ggml.padding_token_id"] == by_text["<|endoftext|>"]
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert types[by_text[text]] == TokenType.CONTROL
    for text in ("<think>", "</think>"):
        assert types[by_text[text]] == TokenType.USER_DEFINED
    assert tokens[-1] == "[PAD999]" and types[-1] == TokenType.UNUSED

    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = "The weather is cold, and the children read a book about the river."
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2.5  # merges learned from English text, not bytes


def test_routing_is_not_uniform(tmp_path):
    path = synthesize(tmp_path / "s.gguf", preset("qwen3moe-tiny", n_layers=1))
    router = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_gate_inp.weight")
    w = np.asarray(router.data, dtype=np.float32)  # [E, D]
    x = np.random.default_rng(0).standard_normal((64, w.shape[1])).astype(np.float32)  # unit-RMS inputs
    logits = x @ w.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert p.max(-1).mean() > 3.0 / w.shape[0]  # a clear favourite per token
    assert len(set(p.argmax(-1).tolist())) > w.shape[0] // 2  # but different ones for different tokens


def test_cli_writes_and_says_random(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert (
        main(["synth", str(out), "--like", "qwen2moe-tiny", "--layers", "2", "--experts-type", "Q6_K"]) == 0
    )
    line = capsys.readouterr().out
    assert str(out) in line and "RANDOM" in line and "MiB" in line
    meta = read_metadata(open_gguf(out))
    assert meta["qwen2moe.block_count"] == 2


def test_cli_explicit_dims_override_preset(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    argv = [
        "synth",
        str(out),
        "--like",
        "qwen3moe-tiny",
        "--arch",
        "qwen3moe",
        "--embd",
        "512",
        "--experts",
        "4",
    ]
    argv += ["--used", "2", "--expert-ff", "256", "--heads", "8", "--kv-heads", "2", "--head-dim", "32"]
    assert main(argv + ["--layers", "1", "--dense-type", "F32", "--vocab", "600"]) == 0
    meta = read_metadata(open_gguf(out))
    assert meta["qwen3moe.embedding_length"] == 512
    assert meta["qwen3moe.expert_count"] == 4
    assert meta["qwen3moe.attention.head_count"] == 8
    assert len(meta["tokenizer.ggml.tokens"]) == 600


def test_bad_requests_are_user_errors(tmp_path, capsys):
    code = main(["synth", str(tmp_path / "m.gguf"), "--like", "qwen3moe-tiny", "--expert-ff", "100"])
    assert code == 2
    err = capsys.readouterr().err
    assert "expert ff 100" in err and "Q4_K" in err
    assert not list(tmp_path.iterdir())
    with pytest.raises(UserError, match="no such directory"):
        synthesize(tmp_path / "missing" / "m.gguf", preset("qwen3moe-tiny"))
    with pytest.raises(UserError, match="MTP"):
        preset("qwen3moe-tiny", mtp=1)


@pytest.mark.parametrize("name", ["qwen35moe-tiny", "qwen3next-tiny", "qwen2moe-tiny", "qwen3moe-tiny"])
def test_forward_pass_is_finite_and_not_degenerate(tmp_path, name):
    # The coordinator's models are checked against transformers and llama.cpp on the fixtures; here they
    # only read a synthetic file, so a layout they cannot load or a scale that blows up shows.
    import torch

    from swarm.compute.store import ExpertStore
    from swarm.coordinator.experts.backend import LocalExperts
    from swarm.coordinator.loader import load_model
    from swarm.sharding.slabs import slabs_from_gguf

    path = synthesize(tmp_path / "s.gguf", preset(name, experts_type="IQ4_XS"))
    model, _ = load_model(path, LocalExperts(ExpertStore(slabs_from_gguf(path))), device="cpu")
    tokens = torch.arange(3, 3 + 16 * 37, 37) % 700
    logits = model.run(tokens, model.new_state())
    assert torch.isfinite(logits).all()
    assert 0.5 < float(logits.std()) < 20.0
    assert len(set(logits.argmax(-1).tolist())) > 4  # different contexts, different predictions


def test_q4_k_m_fixture_names_shapes_and_slab_bytes(tmp_path):
    # llama-quantize's Q4_K_M mixes types per tensor (we write one type per kind), so compare names,
    # shapes, and the Q4_K expert slabs' byte size.
    ref = open_gguf(FIXTURES / "qwen35moe-quant/model-q4_k_m.gguf")
    spec = spec_like(read_metadata(ref), "Q4_K", "F16")
    got = open_gguf(synthesize(tmp_path / "s.gguf", spec))

    def shapes(reader: GGUFReader) -> dict[str, list[int]]:
        return {
            t.name: t.shape.tolist() for t in reader.tensors if not t.name.endswith("gate_inp_shexp.weight")
        }

    assert shapes(got) == shapes(ref)
    ref_slabs = {x.name: x.slab_bytes for x in expert_tensors(ref) if x.qtype == GGMLQuantizationType.Q4_K}
    got_slabs = {x.name: x.slab_bytes for x in expert_tensors(got)}
    assert ref_slabs and all(got_slabs[name] == n for name, n in ref_slabs.items())
