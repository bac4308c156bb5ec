"""llama.cpp beside swarm, where it is built (outside the repo; docs/BENCHMARKS.md says how): llama-bench,
llama-batched-bench and its RPC servers on loopback, run on the same GGUF with the same threads."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from _loopback import LOOPBACK, free_port, wait_port
from _timing import Run

DEFAULT_BUILD = Path("/work/llamacpp-build/build/bin")
# The same llama.cpp built for the AVX2 baseline, the x86 level swarm's ggml is built for (README): how much of
# the gap to llama.cpp is the instruction set rather than the engine.
AVX2_BUILD = Path("/work/llamacpp-avx2/build/bin")
AVX2_CMAKE = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"


def llama_bench(
    binary: Path, gguf: Path, threads: int, n_prompt: int, n_decode: int, rpc: Sequence[str] = ()
) -> Run:
    """One llama-bench run (its own warm-up, then one timed pp and one timed tg test); tokens/s of each."""
    cmd = [str(binary), "-m", str(gguf), "-p", str(n_prompt), "-n", str(n_decode), "-t", str(threads)]
    cmd += ["-r", "1", "-o", "json"]
    if rpc:
        cmd += ["--rpc", ",".join(rpc), "-ngl", "99"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    rows = json.loads(proc.stdout)
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return Run(float(pp["avg_ts"]), float(tg["avg_ts"]))


def run_llama_rpc(
    bench_bin: Path,
    server_bin: Path,
    gguf: Path,
    threads: int,
    n_servers: int,
    server_threads: int,
    n_prompt: int,
    n_decode: int,
    workdir: Path,
) -> Run:
    with rpc_servers(server_bin, n_servers, server_threads, workdir) as endpoints:
        return llama_bench(bench_bin, gguf, threads, n_prompt, n_decode, endpoints)


@contextlib.contextmanager
def rpc_servers(server_bin: Path, n_servers: int, server_threads: int, workdir: Path) -> Iterator[list[str]]:
    """n llama.cpp `ggml-rpc-server` processes on loopback (`-t server_threads` each): their endpoints, while
    the block runs; stopped after it."""
    procs: list[tuple[subprocess.Popen, Any]] = []
    endpoints = []
    try:
        for i in range(n_servers):
            port = free_port()
            logf = open(workdir / f"rpc-server{i}.log", "wb")  # noqa: SIM115 (closed below)
            cmd = [str(server_bin), "-H", LOOPBACK, "-p", str(port), "-t", str(server_threads)]
            procs.append((subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT), logf))
            endpoints.append(f"{LOOPBACK}:{port}")
        for ep in endpoints:
            wait_port(ep, 30.0)
        yield endpoints
    finally:
        for p, _ in procs:
            p.terminate()
        for p, logf in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logf.close()


def llama_version(binary: Path) -> str:
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return next((line for line in text if "version" in line), "unknown version")


BATCHED_COLUMNS = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")


def batched_bench(
    binary: Path, gguf: Path, threads: int, prompt_tokens: int, max_tokens: int
) -> dict[str, float]:
    """llama.cpp's model alone (`llama-batched-bench`): tok/s reading 1 and 8 prompts of prompt_tokens in one
    batch (prefill1, prefill8), and of generating max_tokens for 1 and 8 sequences (decode1, decode8: every
    step of them, averaged, as it reports)."""
    ctx = 8 * (prompt_tokens + max_tokens) + 64
    cmd = [str(binary), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_tokens),
           "-ntg", str(max_tokens), "-npl", "1,8", "-t", str(threads)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    out: dict[str, float] = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(BATCHED_COLUMNS) or not cells[2].isdigit():
            continue
        row = dict(zip(BATCHED_COLUMNS, cells, strict=True))
        b = int(row["B"])
        out[f"prefill{b}"] = float(row["S_PP t/s"])
        out[f"decode{b}"] = float(row["S_TG t/s"])
    if set(out) != {"prefill1", "prefill8", "decode1", "decode8"}:
        raise RuntimeError(f"{binary}: no figures in its output (rc {proc.returncode}): {proc.stderr[-500:]}")
    return out
