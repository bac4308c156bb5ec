"""`swarm inspect`: its figures against an independent count made with gguf's reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from swarm.coordinator.cli import main
from swarm.sharding.shard import shard_model

FIXTURES = Path(__file__).parent / "fixtures"


def rows(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition("  ")
        out[key.strip()] = value.strip()
    return out


def test_inspect_gguf_and_shard_dir(tmp_path, capsys):
    src = FIXTURES / "qwen35moe-quant/model-q4_k_m.gguf"
    r = GGUFReader(src)
    exps = [t for t in r.tensors if "_exps." in t.name]
    expert_bytes = sum(int(t.n_bytes) for t in exps)
    size = src.stat().st_size
    n_expert = int(exps[0].shape[-1])
    layers = sorted({t.name.split(".")[1] for t in exps})
    slab0 = sum(int(t.n_bytes) for t in exps if t.name.startswith("blk.0.")) // n_expert

    assert main(["inspect", str(src)]) == 0
    got = rows(capsys.readouterr().out)
    assert got["architecture"] == "qwen35moe"
    assert got["experts per layer"] == f"{n_expert}, top-2 used per token"
    assert got["experts"].endswith(f"({100 * expert_bytes / size:.1f} % of the file)")
    assert got["slabs"].startswith(f"{len(layers) * n_expert:,} ")
    assert "Q4_K" in got["expert quant types"] and "Q6_K" in got["expert quant types"]
    assert f"{slab0 / 1000:.1f} KB" in got["bytes per (layer, expert) slab"]

    out = tmp_path / "o"
    shard_model(src, out)
    assert main(["inspect", str(out)]) == 0
    shard_rows = rows(capsys.readouterr().out)
    for key in ("architecture", "experts per layer", "experts", "slabs", "bytes per (layer, expert) slab"):
        assert shard_rows[key] == got[key], key


def test_inspect_bad_file(tmp_path, capsys):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGUF\x03\x00")
    assert main(["inspect", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "truncated" in err


def test_a_tensor_of_a_type_that_holds_no_weights_is_refused_in_one_line(tmp_path, capsys):
    # A flipped type word can name an integer type whose byte count still matches the shape (I8: one byte an
    # element); gguf-py cannot decode it, so it must be refused when the file is opened, not when computed.
    p = tmp_path / "i8.gguf"
    w = GGUFWriter(p, "qwen35moe")
    w.add_tensor("blk.0.ffn_up_exps.weight", np.ones((4, 32, 64), dtype=np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert GGUFReader(p).tensors[0].tensor_type == GGMLQuantizationType.I8

    for command in (["inspect", str(p)], ["shard", str(p), "-o", str(tmp_path / "o")], ["node", str(p)]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "'blk.0.ffn_up_exps.weight' is of type I8" in err, (command, err)
    assert not (tmp_path / "o").exists()
