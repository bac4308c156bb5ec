"""`swarm run`, `swarm logits`, `swarm perplexity` and `swarm demo` as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import psutil
import pytest
from conftest import FIXTURES
from reference import assert_logits_close, mean_kl

from swarm.coordinator.cli import main

QWEN3MOE = FIXTURES / "qwen3moe-tiny" / "model-f32.gguf"


def test_logits_match_transformers(tmp_path, capsys):
    ref = np.load(FIXTURES / "qwen3moe-tiny" / "reference.npz")
    tokens = ",".join(str(t) for t in ref["tokens_0"])
    out = tmp_path / "out.npy"
    assert main(["logits", str(QWEN3MOE), "--local", "--tokens", tokens, "-o", str(out)]) == 0
    assert_logits_close(np.load(out), ref["hf_logits_0"], "swarm logits vs transformers")
    assert "wrote" in capsys.readouterr().out


def test_logits_default_is_llama_cpps_numerics_and_exact_is_transformers(tmp_path, capsys):
    """On a Q4_K_M file: the default numerics lands next to llama.cpp's own kernels, --exact next to the
    engines run on the exactly dequantized weights; the two differ."""
    gguf = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"
    ref = np.load(FIXTURES / "qwen35moe-quant" / "reference.npz")
    tokens = ",".join(str(t) for t in ref["tokens_0"])
    native, exact = tmp_path / "native.npy", tmp_path / "exact.npy"
    assert main(["logits", str(gguf), "--local", "--tokens", tokens, "-o", str(native)]) == 0
    assert main(["logits", str(gguf), "--local", "--exact", "--tokens", tokens, "-o", str(exact)]) == 0
    assert_logits_close(np.load(exact), ref["hfdq_q4_k_m_logits_0"], "--exact vs transformers (dequantized)")
    # llama.cpp fed one token per call (its per-row kernels, the ones whose rows never depend on the batch)
    # computes what the default numerics computes; its default kernels (tiled and repacked GEMMs for prompts)
    # sit further away, exact math further still. The criterion over every fixture prompt is
    # tests/test_native.py's.
    per_row = np.load(FIXTURES / "llama-refs" / "fixture-qwen35moe-quant-q4_k_m.npz")[
        "llama_rowwise_logits_0"
    ]
    assert_logits_close(
        np.load(native), per_row, "native vs llama.cpp per row", max_abs=0.05, max_mean_kl=1e-5
    )
    llama = ref["llama_q4_k_m_logits_0"]
    assert mean_kl(llama, np.load(native)) < mean_kl(llama, np.load(exact)) / 5
    assert not np.allclose(np.load(native), np.load(exact), atol=1e-3)


def test_run_local_streams_text_and_reports_speed(capsys):
    rc = main(["run", str(QWEN3MOE), "--local", "--prompt", "def add(a, b):", "--max-tokens", "5"])
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.out.strip(), "some text was generated"
    assert "prefill:" in captured.err and "decode: 5 tokens" in captured.err


def test_run_greedy_continues_like_transformers(capsys):
    """The text prompt of the fixture, greedy: the generated text is what transformers' greedy ids decode to."""
    import json

    from swarm.coordinator.text.tokenizer import GGUFTokenizer
    from swarm.sharding.gguf_io import open_gguf, read_metadata

    meta = json.loads((FIXTURES / "qwen3moe-tiny" / "meta.json").read_text())
    ref = np.load(FIXTURES / "qwen3moe-tiny" / "reference.npz")
    tok = GGUFTokenizer(read_metadata(open_gguf(QWEN3MOE)))
    text = meta["prompts"][0]["text"]
    assert tok.encode(text, parse_special=False) == ref["tokens_0"].tolist()
    rc = main(["run", str(QWEN3MOE), "--local", "--prompt", text, "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert rc == 0
    expected = tok.decode(ref["hf_greedy_0"].tolist(), skip_control=True)
    eos = [i for i, t in enumerate(ref["hf_greedy_0"].tolist()) if t in tok.eos_ids]
    if eos:
        expected = tok.decode(ref["hf_greedy_0"].tolist()[: eos[0]], skip_control=True)
    assert out.rstrip("\n") == expected


def test_perplexity_matches_the_transformers_logits(tmp_path, capsys):
    """The fixture's text prompt scored by `swarm perplexity` == perplexity from transformers' logits."""
    import json

    meta = json.loads((FIXTURES / "qwen3moe-tiny" / "meta.json").read_text())
    ref = np.load(FIXTURES / "qwen3moe-tiny" / "reference.npz")
    tokens, logits = ref["tokens_0"], ref["hf_logits_0"].astype(np.float64)
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    expected = float(np.exp(-logp[np.arange(len(tokens) - 1), tokens[1:]].mean()))
    text = tmp_path / "t.txt"
    text.write_text(meta["prompts"][0]["text"])
    assert main(["perplexity", str(QWEN3MOE), str(text), "--local", "--ctx", "64"]) == 0
    line = capsys.readouterr().out
    ppl = float(line.split("perplexity:")[1].split()[0])
    assert abs(ppl - expected) / expected < 1e-3, (ppl, expected)


def test_user_mistakes_are_one_line_errors(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.gguf"), "--local", "--prompt", "x"]) == 2
    assert main(["run", str(QWEN3MOE), "--no-mdns", "--prompt", "x"]) == 2
    assert main(["logits", str(QWEN3MOE), "--local", "--tokens", "1,x", "-o", str(tmp_path / "o.npy")]) == 2
    assert main(["logits", str(QWEN3MOE), "--local", "--tokens", "99999", "-o", str(tmp_path / "o.npy")]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 4 and all(ln.startswith("swarm ") and "error:" in ln for ln in lines), err
    assert "Traceback" not in err
    assert "swarm node" in lines[1]


@pytest.mark.slow
def test_demo_end_to_end_leaves_no_process_behind(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm.coordinator.cli",
            "demo",
            "--workdir",
            str(tmp_path),
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RANDOM" in proc.stdout
    assert "agreement: swarm and in-process logits are bit-identical" in proc.stdout
    assert "agreement after the loss: still bit-identical to in-process" in proc.stdout
    found = re.search(r"found (\d+) nodes by mDNS", proc.stdout)
    assert found and int(found.group(1)) >= 4, "the replica too"
    assert "stopped 4 node processes" in proc.stdout
    leftovers = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(str(tmp_path) in part for part in (p.info["cmdline"] or []))
    ]
    assert not leftovers, f"processes left behind: {leftovers}"


def test_a_peer_with_another_key_is_a_one_line_error(tmp_path, capsys):
    from swarm.coordinator.cli.spawn import start_nodes
    from swarm.node.auth import generate_key_text

    (node,) = start_nodes([(QWEN3MOE, ["--no-mdns"])], tmp_path, env={"SWARM_KEY": generate_key_text()})
    ours = tmp_path / "our.key"
    ours.write_text(generate_key_text())
    try:
        argv = [
            "run",
            str(QWEN3MOE),
            "--no-mdns",
            "--peer",
            node.address,
            "--key-file",
            str(ours),
            "--prompt",
            "x",
        ]
        assert main(argv) == 2
    finally:
        node.stop()
    err = capsys.readouterr().err.strip()
    assert err.startswith("swarm run: error: ") and "refuses this swarm key" in err and "\n" not in err, err
