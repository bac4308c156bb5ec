"""bench/shard: `swarm shard` throughput as a ratio to `cp` of the same file, and the shard's peak RSS.

    python bench/shard.py [--layers 10] [--repeats 3] [--workdir /tmp/swarm-bench-shard]

Synthesizes a `swarm synth --like qwen3.6-35b-a3b` model with Q4_K experts (10 layers: about 5 GB), then
runs `cp MODEL COPY && sync -f COPY` and `swarm shard MODEL -o DIR -q` (which ends with its own syncfs)
alternately, each from a cold page cache when the kernel lets us drop it (root), else from a warm one;
reports medians and records them in docs/BENCHMARKS.md between the `bench:shard` markers. The big files
are deleted at the end (the disk is shared) unless --keep.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from _doc import replace_section

ROOT = Path(__file__).resolve().parent.parent
SWARM = [sys.executable, "-m", "swarm.coordinator.cli"]
HASH_ONLY = (
    "import hashlib, mmap, sys\n"
    "with open(sys.argv[1], 'rb') as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:\n"
    "    h = hashlib.sha256()\n"
    "    for i in range(0, len(m), 8 << 20):\n"
    "        h.update(memoryview(m)[i : i + (8 << 20)])\n"
)


def drop_caches() -> bool:
    """Empty the page cache (needs root); False where the kernel refuses."""
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        while f.readinto(buf):
            pass


def timed(cmd: list[str]) -> tuple[float, int, float]:
    """(wall seconds, peak RSS in bytes, CPU seconds user+sys) of a child process, measured with wait4."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {proc.returncode}")
    return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def run(args: argparse.Namespace) -> dict[str, object]:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "qwen36-like.gguf"
    if not model.exists():
        print(f"synthesizing {model} ...", file=sys.stderr)
        subprocess.run(
            [*SWARM, "synth", str(model), "--like", "qwen3.6-35b-a3b", "--layers", str(args.layers),
             "--experts-type", "Q4_K"],
            check=True,
        )  # fmt: skip
    size = model.stat().st_size
    if size < 4e9:
        raise SystemExit(f"{model} is {size / 1e9:.2f} GB; use more --layers to get at least 4 GB")
    copy, out = work / "copy.gguf", work / "shards"
    cold = drop_caches()
    cmds = {
        "cp": ["sh", "-c", f"cp '{model}' '{copy}' && sync -f '{copy}'"],
        "shard": [*SWARM, "-v", "shard", str(model), "-o", str(out), "-q"],  # -v: its phase timings
    }
    times: dict[str, list[float]] = {"cp": [], "shard": []}
    cpu: dict[str, list[float]] = {"cp": [], "shard": []}
    rss: list[int] = []
    load_before = os.getloadavg()[0]
    for i in range(args.repeats):
        for name in ("cp", "shard") if i % 2 == 0 else ("shard", "cp"):
            shutil.rmtree(out, ignore_errors=True)
            copy.unlink(missing_ok=True)
            if not (cold and drop_caches()):
                warm(model)
            wall, peak, cpu_s = timed(cmds[name])
            times[name].append(wall)
            cpu[name].append(cpu_s)
            if name == "shard":
                rss.append(peak)
            print(f"run {i + 1} {name}: {wall:.2f} s ({size / wall / 1e6:.0f} MB/s)", file=sys.stderr)
    if args.verify:
        subprocess.run([*SWARM, "shard", "--verify", str(out), str(model)], check=True)
    # The floor of the hashing alone: SHA-256 of every byte, one thread, warm cache.
    warm(model)
    hash_s = timed([sys.executable, "-c", HASH_ONLY, str(model)])[2]
    n_files = sum(1 for _ in (out / "experts").rglob("*.gguf"))
    shutil.rmtree(out, ignore_errors=True)
    copy.unlink(missing_ok=True)
    if not args.keep:
        model.unlink()
    cp_med, sh_med = statistics.median(times["cp"]), statistics.median(times["shard"])
    return {
        "size": size,
        "layers": args.layers,
        "cold": cold,
        "times": times,
        "cp": cp_med,
        "shard": sh_med,
        "ratio": cp_med / sh_med,
        "rss": rss,
        "cpu": {k: statistics.median(v) for k, v in cpu.items()},
        "hash_cpu": hash_s,
        "files": n_files,
        "load": (load_before, os.getloadavg()[0]),
    }


def render(r: dict[str, object], command: str) -> str:
    size = float(r["size"])  # type: ignore[arg-type]
    times = r["times"]
    assert isinstance(times, dict)
    rss = r["rss"]
    assert isinstance(rss, list)
    ratio = float(r["ratio"])  # type: ignore[arg-type]
    cache = (
        "cold page cache before every run (`sync; echo 3 > /proc/sys/vm/drop_caches`)"
        if r["cold"]
        else ("warm page cache (dropping it was not permitted): the source was read once before every run")
    )
    cpu = r["cpu"]
    assert isinstance(cpu, dict)
    load = r["load"]
    assert isinstance(load, tuple)
    lines = [
        "## Shard: `swarm shard` vs `cp` of the same file (`bench/shard.py`)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"one ext4 disk (source and outputs on the same file system); load average {load[0]:.1f} before, "
        f"{load[1]:.1f} after (the machine is shared: read the ratio); "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC.  ",
        f"Model: `swarm synth --like qwen3.6-35b-a3b --layers {r['layers']} --experts-type Q4_K`, "
        f"{size / 1e9:.2f} GB, cut into {r['files']:,} slab files + dense.gguf.  ",
        f"Cache: {cache}. Both commands end with a flush to disk (`cp` + `sync -f`; the shard's syncfs). "
        "Runs alternate cp/shard order; medians.",
        "",
        "| | cp + sync | swarm shard |",
        "| --- | ---: | ---: |",
        "| runs (s) | "
        + ", ".join(f"{t:.2f}" for t in times["cp"])
        + " | "
        + ", ".join(f"{t:.2f}" for t in times["shard"])
        + " |",
        f"| median (s) | {r['cp']:.2f} | {r['shard']:.2f} |",
        f"| throughput (MB/s) | {size / float(r['cp']) / 1e6:.0f} | {size / float(r['shard']) / 1e6:.0f} |",  # type: ignore[arg-type]
        f"| median CPU s (user+sys) | {cpu['cp']:.2f} | {cpu['shard']:.2f} |",
        "",
        f"SHA-256 of the file alone (one thread, warm cache) costs {r['hash_cpu']:.2f} CPU s: the shard has to "
        "spend that on top of the copy (the fingerprint and every manifest hash), on a second thread. The shard "
        "needs more CPU than cp (hashing, one file per slab), so the ratio depends on free cores: with the "
        "2 cores busy with other work (load average 4-7) it measured 0.4-0.65 here.",
        "",
        f"**Shard throughput / cp throughput: {ratio:.2f}** (goal >= 0.8).  ",
        f"**Peak RSS of the shard process: {max(rss) / 2**20:.0f} MiB** (max over runs; goal < 256 MB).",
    ]
    return "\n".join(lines)


def write_section(text: str) -> None:
    replace_section("shard", text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=10, help="layers of the synthesized model (10: ~5 GB)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each command")
    p.add_argument("--workdir", default="/tmp/swarm-bench-shard", help="where the big files go")
    p.add_argument("--keep", action="store_true", help="keep the synthesized model for another run")
    p.add_argument("--verify", action="store_true", help="check the last cut against the model")
    p.add_argument("--no-docs", action="store_true", help="print, do not write docs/BENCHMARKS.md")
    args = p.parse_args()
    r = run(args)
    text = render(r, "python bench/shard.py " + " ".join(sys.argv[1:]))
    print(text)
    if not args.no_docs:
        write_section(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
