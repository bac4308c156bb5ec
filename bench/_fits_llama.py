"""llama.cpp on one capped device for bench/fits.py: llama-bench in a memory group, one phase a process so
that the bytes it reads from disk are its phase's (the blkio group beside the memory group counts them)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _fits_groups import JOIN, Device, drop_page_cache


@dataclass(frozen=True)
class Phase:
    """One llama-bench process: its tok/s (None: it did not finish), the group's peak memory, bytes read."""

    tps: float | None
    peak: int
    read: int | None
    why: str = ""  # why there is no figure


def llama_phase(
    binary: Path,
    gguf: Path,
    threads: int,
    limit: int | None,
    n_prompt: int,
    n_decode: int,
    repack: bool,
    warmup: bool = True,
    reps: int = 1,
    device: Any = None,
) -> Phase:
    """llama-bench's pp test (n_decode 0) or tg test (n_prompt 0) in a fresh group capped at `limit`, the file
    out of the page cache first; mmap on (its default: the file's pages are page cache, which the kernel
    evicts under the cap and reads again at the next use). `reps` timed repetitions in the one process: the
    median of their tok/s. `device`: another device with a memory group's methods (bench/_rig.py's), used
    and closed instead of a fresh memory group."""
    drop_page_cache(gguf)
    dev = device if device is not None else Device(limit, "llama", gguf)
    cmd = [sys.executable, "-c", JOIN, *dev.procs(), "--", str(binary), "-m", str(gguf), "-p", str(n_prompt),
           "-n", str(n_decode), "-t", str(threads), "-r", str(reps), "-o", "json", "--repack", str(int(repack)),
           *([] if warmup else ["--no-warmup"])]  # fmt: skip
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired:
            return Phase(None, dev.peak(), dev.read_bytes(), "no result in 900 s")
        if proc.returncode != 0:
            killed = dev.oom_kills() > 0
            why = (
                "killed by the cap (OOM)" if killed else f"exit code {proc.returncode}: {proc.stderr[-300:]}"
            )
            return Phase(None, dev.peak(), dev.read_bytes(), why)
        rows = json.loads(proc.stdout)
        row = next(
            r for r in rows if (r["n_prompt"] > 0) == (n_prompt > 0) and (r["n_gen"] > 0) == (n_decode > 0)
        )
        samples = row.get("samples_ts") or [row["avg_ts"]]
        return Phase(float(statistics.median(samples)), dev.peak(), dev.read_bytes())
    finally:
        dev.close()


@dataclass(frozen=True)
class LlamaCapped:
    """llama.cpp at one cap: prompt and decode tok/s, peak memory, and the disk bytes a decode token reads."""

    prompt: Phase
    decode: Phase
    read_per_token: float | None

    @property
    def peak(self) -> int:
        return max(self.prompt.peak, self.decode.peak)


def llama_capped(
    binary: Path,
    gguf: Path,
    threads: int,
    limit: int | None,
    n_prompt: int,
    n_decode: int,
    repack: bool,
    reps: int = 1,
) -> LlamaCapped:
    """The pp phase, the tg phase, and a one-token tg phase without warm-up: the tg phase reads the load's
    bytes, its warm-up token's and reps x n_decode tokens', the short one the load's and one token's, so their
    difference over reps x n_decode is what a decode token reads."""
    prompt = llama_phase(binary, gguf, threads, limit, n_prompt, 0, repack, reps=reps)
    decode = llama_phase(binary, gguf, threads, limit, 0, n_decode, repack, reps=reps)
    per_token = None
    if decode.tps is not None and decode.read is not None:
        one = llama_phase(binary, gguf, threads, limit, 0, 1, repack, warmup=False)
        if one.read is not None and one.tps is not None:
            per_token = max(0.0, (decode.read - one.read) / (reps * n_decode))
    return LlamaCapped(prompt, decode, per_token)
