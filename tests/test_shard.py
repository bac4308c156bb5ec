"""`swarm shard`: every byte of the source lands where it should, and nothing that is wrong verifies.

The checks read the outputs through gguf's own GGUFReader (not through swarm's reader) and compare
with the source bytes as gguf reads them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from swarm.coordinator.cli import main
from swarm.sharding.errors import UserError
from swarm.sharding.journal import JOURNAL_NAME
from swarm.sharding.manifest import read_manifest
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import open_dense, read_slab_file, slabs_from_gguf, slabs_from_shard
from swarm.sharding.verify import verify_shard

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_GGUFS = sorted(p.relative_to(FIXTURES).as_posix() for p in FIXTURES.glob("*/model-*.gguf"))
EXPERT_SUFFIXES = ("_exps.weight", "_exps.bias")


def raw(t) -> bytes:
    return t.data.tobytes()


def make_moe_gguf(
    path: Path,
    n_layer: int = 2,
    n_expert: int = 4,
    d: int = 64,
    f: int = 32,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    seed: int = 0,
    fused: bool = False,
    bias: bool = False,
) -> Path:
    """A small qwen3moe-shaped GGUF with random bytes (byte-copy tests need no meaningful weights)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(path, "qwen3moe")
    w.add_block_count(n_layer)
    w.add_embedding_length(d)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(f)
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "\u00e9"])
    w.add_float32("swarm.test.f", 0.1)

    def add(name: str, shape: tuple[int, ...], qt: GGMLQuantizationType) -> None:
        if qt == GGMLQuantizationType.F32:
            w.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
        else:
            from gguf import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[qt]
            nbytes = int(np.prod(shape)) // block * size
            data = rng.integers(0, 256, nbytes, dtype=np.uint8)
            w.add_tensor(name, data.reshape(*shape[:-1], -1), raw_dtype=qt)

    add("token_embd.weight", (16, d), GGMLQuantizationType.F32)
    for i in range(n_layer):
        add(f"blk.{i}.ffn_gate_inp.weight", (n_expert, d), GGMLQuantizationType.F32)
        if fused:
            add(f"blk.{i}.ffn_gate_up_exps.weight", (n_expert, 2 * f, d), qtype)
        else:
            add(f"blk.{i}.ffn_gate_exps.weight", (n_expert, f, d), qtype)
            add(f"blk.{i}.ffn_up_exps.weight", (n_expert, f, d), qtype)
        add(f"blk.{i}.ffn_down_exps.weight", (n_expert, d, f), qtype)
        if bias:
            add(f"blk.{i}.ffn_down_exps.bias", (n_expert, d), GGMLQuantizationType.F32)
        add(f"blk.{i}.attn_norm.weight", (d,), GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def check_shard_against_source(src: Path, out: Path) -> None:
    """Every expert tensor = its slabs in expert order; dense.gguf = every other tensor and every key."""
    s = GGUFReader(src)
    m = read_manifest(out)
    experts = {t.name: t for t in s.tensors if t.name.endswith(EXPERT_SUFFIXES)}
    assert experts, "the source should have expert tensors"
    n_expert = {int(t.shape[-1]) for t in experts.values()}.pop()
    assert m.n_expert == n_expert
    layers = sorted({int(n.split(".")[1]) for n in experts})
    assert list(m.moe_layers) == layers
    slab_readers = {
        (layer, e): GGUFReader(out / "experts" / str(layer) / f"{e}.gguf")
        for layer in layers
        for e in range(n_expert)
    }
    for name, t in experts.items():
        layer = int(name.split(".")[1])
        pieces = []
        for e in range(n_expert):
            r = slab_readers[(layer, e)]
            (st,) = [x for x in r.tensors if x.name == name]
            assert st.tensor_type == t.tensor_type
            assert st.shape.tolist() == t.shape.tolist()[:-1]  # ggml order: the expert dim was outermost
            pieces.append(raw(st))
        assert b"".join(pieces) == raw(t), name
    for (layer, e), r in slab_readers.items():
        assert {x.name for x in r.tensors} == {n for n in experts if n.startswith(f"blk.{layer}.")}
        meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
        assert meta["general.architecture"] == s.fields["general.architecture"].contents()
        assert meta["swarm.layer"] == layer and meta["swarm.expert"] == e
        assert meta["swarm.fingerprint"] == m.fingerprint
    d = GGUFReader(out / "dense.gguf")
    dense_src = [t for t in s.tensors if t.name not in experts]
    assert [t.name for t in d.tensors] == [t.name for t in dense_src]
    for a, b in zip(d.tensors, dense_src, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist()
        assert raw(a) == raw(b), a.name
    src_keys = {k: f for k, f in s.fields.items() if not k.startswith("GGUF.")}
    dense_keys = {k: f for k, f in d.fields.items() if not k.startswith("GGUF.")}
    assert list(dense_keys) == list(src_keys)
    for k, f in src_keys.items():
        g = dense_keys[k]
        assert g.types == f.types, k
        assert [p.tobytes() for p in g.parts] == [p.tobytes() for p in f.parts], k


def tree_bytes(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", FIXTURE_GGUFS)
def test_fixture_round_trip(name, tmp_path):
    src = FIXTURES / name
    out = tmp_path / "shards"
    assert main(["shard", str(src), "-o", str(out), "--quiet"]) == 0
    check_shard_against_source(src, out)
    assert verify_shard(out, src) == []
    # The node's loader gives the same slabs as slicing the whole model.
    got, problems = slabs_from_shard(out)
    assert problems == []
    want = slabs_from_gguf(src)
    assert got.keys() == want.keys()
    for key, kinds in want.items():
        assert got[key].keys() == kinds.keys()
        for kind, t in kinds.items():
            g = got[key][kind]
            assert (g.kind, g.qtype, g.shape) == (t.kind, t.qtype, t.shape)
            assert g.data.tobytes() == t.data.tobytes()
    assert len(open_dense(out, verify=True).tensors) == len(GGUFReader(out / "dense.gguf").tensors)
    assert not (out / JOURNAL_NAME).exists()
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name or p.name.endswith(".pending")]


@pytest.mark.parametrize(
    "qtype,fused,bias",
    [
        (GGMLQuantizationType.Q8_0, True, False),
        (GGMLQuantizationType.Q4_K, False, True),
        (GGMLQuantizationType.F16, False, False),
    ],
)
def test_fused_bias_and_quant_layouts(tmp_path, qtype, fused, bias):
    src = make_moe_gguf(tmp_path / "m.gguf", d=256, f=256, qtype=qtype, fused=fused, bias=bias)
    out = tmp_path / "out"
    shard_model(src, out)
    check_shard_against_source(src, out)
    slabs = read_slab_file(out / "experts/1/3.gguf")
    want = (
        {"ffn_gate_up_exps", "ffn_down_exps"} if fused else {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}
    )
    assert set(slabs) == want | ({"ffn_down_exps.bias"} if bias else set())
    if bias:
        assert slabs["ffn_down_exps.bias"].shape == (256,)
    d = GGUFReader(out / "dense.gguf")
    assert d.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "\u00e9"]


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_verify_names_every_flipped_byte(tmp_path):
    src = FIXTURES / "qwen35moe-quant/model-q4_k_m.gguf"
    out = tmp_path / "out"
    shard_model(src, out)
    m = read_manifest(out)
    data_flip = m.slab(2, 5)
    head_flip = m.slab(0, 1)
    flip(out / data_flip.path, data_flip.size - 7)
    flip(out / head_flip.path, 40)  # inside the metadata
    flip(out / "dense.gguf", m.dense.size // 2)
    problems = verify_shard(out)
    assert len(problems) == 3
    assert any("experts/2/5.gguf" in p and "data" in p for p in problems)
    assert any("experts/0/1.gguf" in p and "header" in p for p in problems)
    assert any("dense.gguf" in p for p in problems)
    loaded, bad = slabs_from_shard(out, layers=[0, 2], experts=[1, 5])
    assert set(loaded) == {(0, 5), (2, 1)}
    assert (
        len(bad) == 2
        and any("experts/2/5.gguf" in p for p in bad)
        and any("experts/0/1.gguf" in p for p in bad)
    )
    with pytest.raises(UserError, match="dense.gguf"):
        open_dense(out, verify=True)


def test_lazy_slabs_read_each_file_once_when_drawn_and_pass_over_unreadable_ones(tmp_path, caplog):
    """A coordinator's audit slabs: listed from the manifest without reading a file, each file read on its
    first use and kept; a file cut short or gone is not in the mapping (said once), the others are the same
    bytes and compute the same bits as slabs read all at once."""
    import logging

    import torch

    from swarm.compute.expert_weights import slab_dims
    from swarm.compute.store import ExpertStore
    from swarm.sharding.slabs import LazySlabs

    src = FIXTURES / "qwen35moe-quant/model-q4_k_m.gguf"
    whole, damaged = tmp_path / "whole", tmp_path / "damaged"
    shard_model(src, whole)
    shutil.copytree(whole, damaged)
    m = read_manifest(damaged)
    (damaged / m.slab(1, 3).path).write_bytes(b"GGUF\x03\x00")  # cut short
    (damaged / m.slab(2, 5).path).unlink()
    with open(damaged / m.slab(0, 7).path, "r+b") as f:  # cut short after layer 0's first file is read
        f.truncate(m.slab(0, 7).size - 100)
    eager, _ = slabs_from_shard(whole, verify=False)
    lazy = LazySlabs(damaged, dims=slab_dims)
    assert len(lazy) == len(eager) and set(lazy) == set(eager) and not lazy._read  # listed, none read
    with caplog.at_level(logging.WARNING, logger="swarm.sharding.slabs"):
        assert (1, 3) not in lazy and (2, 5) not in lazy
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert lazy[(0, 2)] is lazy[(0, 2)] and len(lazy._read) == 3
    assert (0, 7) not in lazy  # (mapped where layer 0's first file had its tensors: too short for them)
    for key in ((0, 2), (0, 6), (3, 1)):  # the first file of a layer read whole, the next ones mapped
        for kind, s in lazy[key].items():
            want = eager[key][kind]
            assert (s.qtype, s.shape) == (want.qtype, want.shape) and np.array_equal(s.data, want.data)
    rows = torch.randn(5, m.n_embd, generator=torch.Generator().manual_seed(0))
    ours = ExpertStore(lazy, "cpu", stacked=False).compute(0, [2, 6], [3, 2], rows)
    want = ExpertStore(eager, "cpu", stacked=False).compute(0, [2, 6], [3, 2], rows)
    assert torch.equal(ours, want)


def test_verify_cli_exit_status(tmp_path, capsys):
    src = FIXTURES / "qwen2moe-tiny/model-f32.gguf"
    out = tmp_path / "out"
    assert main(["shard", str(src), "-o", str(out), "-q"]) == 0
    assert main(["shard", "--verify", str(out), str(src)]) == 0
    m = read_manifest(out)
    flip(out / m.slab(3, 29).path, m.slab(3, 29).data_offset + 3)
    capsys.readouterr()
    assert main(["shard", "--verify", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["MISMATCH experts/3/29.gguf: tensor data differs from the manifest (SHA-256 mismatch)"]


def test_verify_against_a_changed_source(tmp_path):
    """The source given to --verify is re-hashed: a byte changed in it is named."""
    src = tmp_path / "m.gguf"
    shutil.copy(FIXTURES / "qwen3moe-tiny/model-f32.gguf", src)
    out = tmp_path / "out"
    shard_model(src, out)
    t = [t for t in GGUFReader(src).tensors if t.name == "blk.1.ffn_up_exps.weight"][0]
    per = int(t.n_bytes) // 32
    flip(src, int(t.data_offset) + 7 * per + 5)  # expert 7
    problems = verify_shard(out, src)
    assert any(p.startswith("experts/1/7.gguf") for p in problems)
    assert any(p.startswith("fingerprint") for p in problems)
    assert verify_shard(out) == []  # the directory itself is still consistent


def fingerprint_of(src: Path, out: Path) -> str:
    return shard_model(src, out, layers=[0], experts=[0]).manifest.fingerprint


def test_fingerprint_follows_every_byte(tmp_path):
    base = FIXTURES / "qwen3moe-tiny/model-f32.gguf"
    fp0 = fingerprint_of(base, tmp_path / "a")
    assert fingerprint_of(base, tmp_path / "a2") == fp0  # deterministic
    r = GGUFReader(base)
    expert = [t for t in r.tensors if t.name == "blk.3.ffn_down_exps.weight"][0]
    dense = [t for t in r.tensors if t.name == "output_norm.weight"][0]
    offsets = {
        "expert byte not cut": int(expert.data_offset) + int(expert.n_bytes) - 1,
        "dense byte": int(dense.data_offset) + 2,
        "metadata byte": int(r.fields["qwen3moe.rope.freq_base"].offset) + 30,
    }
    seen = {fp0}
    for i, (what, off) in enumerate(offsets.items()):
        src = tmp_path / f"m{i}.gguf"
        shutil.copy(base, src)
        flip(src, off)
        fp = fingerprint_of(src, tmp_path / f"o{i}")
        assert fp not in seen, what
        seen.add(fp)


def test_partial_cuts_share_the_fingerprint_and_merge(tmp_path):
    src = FIXTURES / "qwen2moe-tiny/model-f32.gguf"
    full = shard_model(src, tmp_path / "full").manifest
    out = tmp_path / "part"
    assert main(["shard", str(src), "-o", str(out), "-q", "--layers", "1-2", "--experts", "0-3,29"]) == 0
    m = read_manifest(out)
    assert m.fingerprint == full.fingerprint
    assert {(s.layer, s.expert) for s in m.slabs} == {(lay, e) for lay in (1, 2) for e in (0, 1, 2, 3, 29)}
    assert sorted(p.relative_to(out).as_posix() for p in (out / "experts").rglob("*.gguf")) == sorted(
        s.path for s in m.slabs
    )
    for s in m.slabs:  # same files as the full cut
        assert (out / s.path).read_bytes() == (tmp_path / "full" / s.path).read_bytes()
    loaded, problems = slabs_from_shard(out, layers=[1], experts=[3, 4])
    assert set(loaded) == {(1, 3)} and len(problems) == 1 and "layer 1 expert 4" in problems[0]
    # a second cut of other experts into the same directory adds to it
    r = shard_model(src, out, experts=[4])
    assert r.skipped == 1  # dense.gguf
    m2 = read_manifest(out)
    assert {(s.layer, s.expert) for s in m2.slabs} == {(s.layer, s.expert) for s in m.slabs} | {
        (lay, 4) for lay in range(4)
    }
    assert verify_shard(out, src) == []


def test_rerun_skips_what_verifies_and_rewrites_what_does_not(tmp_path):
    src = FIXTURES / "qwen35moe-quant/model-q8_0.gguf"
    out = tmp_path / "out"
    first = shard_model(src, out)
    assert first.written == 33 and first.skipped == 0
    before = tree_bytes(out)
    m = first.manifest
    flip(out / m.slab(1, 1).path, m.slab(1, 1).size - 1)
    (out / m.slab(3, 7).path).unlink()
    again = shard_model(src, out)
    assert again.written == 2 and again.skipped == 31
    assert tree_bytes(out) == before


def _shard_cmd(src: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "swarm.coordinator.cli", "shard", str(src), "-o", str(out), "-q"]


@pytest.mark.slow
def test_killed_run_resumes_to_identical_output(tmp_path):
    """SIGKILL half-way (a real process), rerun: byte-identical to an uninterrupted cut; nothing verified before."""
    src = make_moe_gguf(
        tmp_path / "big.gguf", n_layer=4, n_expert=16, d=512, f=256, qtype=GGMLQuantizationType.Q8_0
    )
    ref = tmp_path / "ref"
    shard_model(src, ref)
    out = tmp_path / "out"
    proc = subprocess.Popen(_shard_cmd(src, out))
    journal = out / JOURNAL_NAME
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if len(journal.read_text().splitlines()) >= 12:  # identity + dense + 10 slabs of 64
                break
        except FileNotFoundError:
            pass
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    with pytest.raises(UserError):
        verify_shard(out)  # nothing verifies without a manifest
    assert list(out.rglob("*.pending")), "the kill should have left finished-but-unsealed slabs"
    lines = [json.loads(x) for x in journal.read_text().splitlines() if x.endswith("}")]
    journaled = sum(1 for x in lines if x.get("written"))
    rerun = shard_model(src, out)
    assert rerun.skipped >= journaled >= 10  # what the journal vouches for is kept, not copied again
    assert tree_bytes(out) == tree_bytes(ref)


# ---- bad input: one line, exit status 2, nothing that verifies ----


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err


def test_not_a_gguf(tmp_path, capsys):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, not a model\n")
    rc, err = run_cli(capsys, "shard", str(p), "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "not a GGUF")
    assert not (tmp_path / "o").exists()


def test_truncated_file(tmp_path, capsys):
    src = FIXTURES / "qwen35moe-quant/model-q4_k_m.gguf"
    for keep in (src.stat().st_size - 1000, 20_000, 100):  # in the data, in the metadata, in the header
        p = tmp_path / f"cut{keep}.gguf"
        p.write_bytes(src.read_bytes()[:keep])
        rc, err = run_cli(capsys, "shard", str(p), "-o", str(tmp_path / f"o{keep}"))
        assert_one_line_error(rc, err, "truncated")
        assert not (tmp_path / f"o{keep}" / "manifest.json").exists()


def test_unknown_quant_type(tmp_path, capsys):
    src = FIXTURES / "qwen2moe-tiny/model-f32.gguf"
    r = GGUFReader(src)
    t = r.tensors[0]
    # the tensor info ends with: type (u32), offset (u64); the type sits 12 bytes before the next field.
    info_end = int(r.tensors[1].field.offset) if len(r.tensors) > 1 else None
    data = bytearray(src.read_bytes())
    type_at = info_end - 12
    assert int.from_bytes(data[type_at : type_at + 4], "little") == int(t.tensor_type)
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    p = tmp_path / "odd.gguf"
    p.write_bytes(bytes(data))
    rc, err = run_cli(capsys, "shard", str(p), "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "tensor type", "250")


def test_model_without_experts(tmp_path, capsys):
    p = tmp_path / "dense.gguf"
    w = GGUFWriter(p, "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, err = run_cli(capsys, "shard", str(p), "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "no stacked expert tensors")


def test_directory_of_another_model(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["shard", str(FIXTURES / "qwen2moe-tiny/model-f32.gguf"), "-o", str(out), "-q"]) == 0
    before = tree_bytes(out)
    rc, err = run_cli(capsys, "shard", str(FIXTURES / "qwen3moe-tiny/model-f32.gguf"), "-o", str(out))
    assert_one_line_error(rc, err, "another model", "model-f32.gguf")
    assert tree_bytes(out) == before


def test_bad_ranges_and_missing_output(tmp_path, capsys):
    src = str(FIXTURES / "qwen2moe-tiny/model-f32.gguf")
    assert_one_line_error(*run_cli(capsys, "shard", src), "-o DIR")
    assert_one_line_error(
        *run_cli(capsys, "shard", src, "-o", str(tmp_path / "o"), "--experts", "30"), "0-29"
    )
    assert_one_line_error(
        *run_cli(capsys, "shard", src, "-o", str(tmp_path / "o"), "--layers", "4"), "--layers"
    )
    assert_one_line_error(*run_cli(capsys, "shard", "--verify", str(tmp_path)), "manifest.json")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real, small file system (root can mount tmpfs here); yields a function mounting one."""
    mounts: list[Path] = []

    def mount(name: str, opts: str) -> Path:
        m = tmp_path / name
        m.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(m)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs for the full-disk test (run the tests as root): {r.stderr}")
        mounts.append(m)
        return m

    yield mount
    for m in mounts:
        subprocess.run(["umount", str(m)], check=False)


def test_full_disk_before_writing(small_tmpfs, capsys):
    fs = small_tmpfs("small", "size=1m")
    rc, err = run_cli(capsys, "shard", str(FIXTURES / "qwen35moe-quant/model-q8_0.gguf"), "-o", str(fs / "o"))
    assert_one_line_error(rc, err, "not enough free space", "MB more")
    assert not (fs / "o" / "manifest.json").exists()


def test_disk_full_while_writing(small_tmpfs, capsys):
    """Room for the bytes but not for the files (no inodes left): a real ENOSPC half-way through."""
    fs = small_tmpfs("inodes", "size=64m,nr_inodes=24")
    out = fs / "o"
    rc, err = run_cli(capsys, "shard", str(FIXTURES / "qwen35moe-quant/model-q8_0.gguf"), "-o", str(out))
    assert_one_line_error(rc, err, "disk full")
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    with pytest.raises(UserError):
        verify_shard(out)


def test_file_size_limit(tmp_path):
    """A write refused with EFBIG (RLIMIT_FSIZE) in a real subprocess: one line, exit 2."""
    out = tmp_path / "o"

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    r = subprocess.run(
        _shard_cmd(FIXTURES / "qwen35moe-quant/model-q8_0.gguf", out),
        preexec_fn=limit,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "file size limit" in r.stderr, r.stderr
    assert not (out / "manifest.json").exists()
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]


def test_read_only_output(small_tmpfs, capsys):
    fs = small_tmpfs("ro", "size=1m,ro")
    rc, err = run_cli(capsys, "shard", str(FIXTURES / "qwen2moe-tiny/model-f32.gguf"), "-o", str(fs / "o"))
    assert_one_line_error(rc, err, "cannot write")


def without_root_file_powers() -> None:
    """Root reads and writes through any permission bits; drop those two capabilities in the child."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP: gone after exec
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_model_and_unwritable_directory(tmp_path):
    src = tmp_path / "m.gguf"
    shutil.copy(FIXTURES / "qwen2moe-tiny/model-f32.gguf", src)
    src.chmod(0o000)
    r = subprocess.run(
        _shard_cmd(src, tmp_path / "o"), preexec_fn=without_root_file_powers, capture_output=True, text=True
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "cannot be read" in r.stderr, r.stderr
    src.chmod(0o644)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    for out in (locked, locked / "sub"):
        r = subprocess.run(
            _shard_cmd(src, out), preexec_fn=without_root_file_powers, capture_output=True, text=True
        )
        assert r.returncode == 2, r.stderr
        assert r.stderr.count("\n") == 1 and "cannot write" in r.stderr, r.stderr
    assert list(locked.iterdir()) == []


def test_manifest_errors(tmp_path):
    with pytest.raises(UserError, match="no manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="damaged manifest"):
        read_manifest(tmp_path)
    out = tmp_path / "o"
    shard_model(FIXTURES / "qwen2moe-tiny/model-f32.gguf", out)
    d = json.loads((out / "manifest.json").read_text())
    d["format_version"] = 99
    (out / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match="newer"):
        slabs_from_shard(out)
    del d["slabs"]
    d["format_version"] = 1
    (out / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(UserError, match="not a valid swarm manifest"):
        read_manifest(out)


def test_manifest_facts(tmp_path):
    src = FIXTURES / "qwen35moe-quant/model-q4_k_m.gguf"
    m = shard_model(src, tmp_path / "o").manifest
    assert m.arch == "qwen35moe"
    assert (m.n_layer, m.n_expert, m.n_expert_used, m.n_embd, m.n_ff_exp) == (4, 8, 2, 256, 256)
    assert m.source.name == src.name and m.source.size == src.stat().st_size
    assert m.dense.sha256 == hashlib.sha256((tmp_path / "o/dense.gguf").read_bytes()).hexdigest()
    for s in m.slabs:
        b = (tmp_path / "o" / s.path).read_bytes()
        assert len(b) == s.size
        assert hashlib.sha256(b[: s.data_offset]).hexdigest() == s.header_sha256
        assert hashlib.sha256(b[s.data_offset :]).hexdigest() == s.sha256


SYNTH_PRESETS = ("qwen35moe-tiny", "qwen3next-tiny", "qwen2moe-tiny", "qwen3moe-tiny")


def _synth_cases() -> list[tuple[str, str]]:
    from swarm.sharding.synth_spec import EXPERT_TYPES

    return [(t, SYNTH_PRESETS[i % len(SYNTH_PRESETS)]) for i, t in enumerate(EXPERT_TYPES)]


@pytest.mark.parametrize("qtype,like", _synth_cases())
def test_synth_models_in_every_quant_type(tmp_path, qtype, like):
    from swarm.sharding.synth import synthesize
    from swarm.sharding.synth_spec import preset

    src = synthesize(tmp_path / "m.gguf", preset(like, experts_type=qtype))
    out = tmp_path / "out"
    shard_model(src, out)
    check_shard_against_source(src, out)
    # a mixture (Q4_K_M) gives its experts its base type, and more bits (Q6_K) to ffn_down in its chosen layers
    want = {"Q4_K", "Q6_K"} if qtype == "Q4_K_M" else {qtype}
    assert {t.qtype for t in read_manifest(out).expert_tensors} == want
    assert verify_shard(out, src) == []


def test_expert_dimension_not_outermost(tmp_path, capsys):
    p = tmp_path / "flat.gguf"
    w = GGUFWriter(p, "qwen3moe")
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((64,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, err = run_cli(capsys, "shard", str(p), "-o", str(tmp_path / "o"))
    assert_one_line_error(rc, err, "expert dimension outermost")


def test_unfinished_cut_of_another_model(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / JOURNAL_NAME).write_text(json.dumps({"identity": {"name": "other.gguf", "size": 1}}) + "\n")
    rc, err = run_cli(capsys, "shard", str(FIXTURES / "qwen2moe-tiny/model-f32.gguf"), "-o", str(out))
    assert_one_line_error(rc, err, "unfinished cut of another model", "other.gguf")


def test_without_copy_file_range(tmp_path, monkeypatch):
    """Systems without copy_file_range (macOS) copy through user space: the same bytes."""
    src = FIXTURES / "qwen35moe-quant/model-q4_k_m.gguf"
    shard_model(src, tmp_path / "a")
    monkeypatch.delattr(os, "copy_file_range")
    shard_model(src, tmp_path / "b")
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def test_big_slab_path_gives_the_same_bytes(tmp_path, monkeypatch):
    """Slabs over SMALL_FILE go through the chunked copy (real models' big dense tensors always do)."""
    import swarm.sharding.pump as pump
    import swarm.sharding.source as source

    src = FIXTURES / "qwen35moe-quant/model-q8_0.gguf"
    shard_model(src, tmp_path / "a")
    monkeypatch.setattr(source, "SMALL_FILE", 0)
    monkeypatch.setattr(pump, "CHUNK", 4096)
    shard_model(src, tmp_path / "b")
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")
    assert verify_shard(tmp_path / "b", src) == []


def test_loading_slabs_reports_progress_and_refuses_a_damaged_one(tmp_path: Path) -> None:
    out = tmp_path / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", out)
    entry = read_manifest(out).slab(1, 2)
    assert entry is not None
    with open(out / entry.path, "r+b") as f:  # one flipped byte in the slab's data
        f.seek(entry.size - 1)
        last = f.read(1)
        f.seek(entry.size - 1)
        f.write(bytes([last[0] ^ 0xFF]))
    seen: list[tuple[int, int]] = []
    slabs, problems = slabs_from_shard(out, [0, 1], [0, 1, 2], progress=lambda d, t: seen.append((d, t)))
    assert seen == [(i, 6) for i in range(1, 7)]
    assert sorted(slabs) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert len(problems) == 1 and problems[0].startswith("layer 1 expert 2: ")
