"""An idle node's memory and its time from start to serving, two trees side by side (this one, and a base
checkout: what a node costs before and after a change).

    .venv/bin/python bench/node_idle.py --base /tmp/base [--reps 5] [--workdir /work/bench-models/decode]
                                        [--no-write]

The node is `swarm node DIR --experts 0-63` on a shard directory of the Qwen3.6-35B-A3B layer shape (4
layers, Q4_K experts, bench/_models.py): 64 experts of every layer, 256 slabs, started as a user starts it
(its defaults: slabs hashed against the manifest, repacked copies made, mDNS on loopback). Time to serving:
from the process's start to its ready file (written once it serves and is announced). Memory: VmRSS after 3 s
idle, split into anonymous and file pages, against the slab bytes it holds; and whether torch's library is
mapped into it. The trees alternate run by run; each tree's first run (cold page cache) is not counted.
`--base`: a checkout with its own .venv (git worktree add DIR REV; cp -a .venv DIR/.venv; DIR/.venv/bin/pip
install --no-deps -e DIR). Figures go to the `bench:node-idle` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _doc import machine, replace_section
from _models import prepare

from swarm.sharding.slabs import read_manifest

EXPERTS = "0-63"
IDLE_SECONDS = 3.0
MIB = 2**20


def status_kib(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user + system): what its start-up costs without the machine's load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_answer(ready: dict) -> float:
    """When the node's first Compute answer came back (one row of the first slab it holds)."""
    import numpy as np

    from swarm.node.client import NodeClient

    with NodeClient(ready["address"], fingerprint=ready["fingerprint"]) as client:
        info = client.info()
        layer, expert = min(info.held)
        client.compute(layer, [expert], [1], np.ones((1, info.hidden_size), np.float32), timeout=120)
    return time.perf_counter()


def wait_prepared(ready: Path, proc: subprocess.Popen[bytes]) -> float:
    """When the ready file said every slab was hashed and readied (a tree without that pass: at once, it
    did all that before serving)."""
    while "prepared" in (r := json.loads(ready.read_text())) and not r["prepared"]:
        if proc.poll() is not None:
            raise RuntimeError(f"node exited {proc.returncode}")
        time.sleep(0.02)
    return time.perf_counter()


def one_run(python: Path, shard_dir: Path, tmp: Path) -> dict[str, float]:
    ready = tmp / "ready.json"
    ready.unlink(missing_ok=True)
    cmd = [str(python), "-m", "swarm.coordinator.cli", "node", str(shard_dir), "--experts", EXPERTS,
           "--port", "0", "--ready-file", str(ready), "--exit-with-parent"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp)
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{python}: node exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.005)
        serving = time.perf_counter() - t0
        cpu = cpu_seconds(proc.pid)
        answered = first_answer(json.loads(ready.read_text())) - t0
        prepared = wait_prepared(ready, proc) - t0
        time.sleep(IDLE_SECONDS)
        mem = status_kib(proc.pid)
        torch_mapped = "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        "serving_s": serving,
        "cpu_s": cpu,
        "answer_s": answered,
        "prepared_s": prepared,
        "rss_mib": mem["VmRSS"] / 1024,
        "anon_mib": mem["RssAnon"] / 1024,
        "file_mib": mem["RssFile"] / 1024,
        "torch": float(torch_mapped),
    }


def slab_bytes(shard_dir: Path) -> int:
    manifest = read_manifest(shard_dir)
    return sum(e.size for e in manifest.slabs if e.expert < 64)


def med(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def render(trees: dict[str, list[dict[str, float]]], held: int, cmd: str, base_rev: str, head_rev: str) -> str:
    bound = held / MIB + 150
    lines = [
        f"`{cmd}` on {machine()}; this tree {head_rev} against {base_rev}, alternating, medians of "
        f"{len(next(iter(trees.values())))} warm runs each.",
        "",
        f"`swarm node DIR --experts {EXPERTS}` on the 4-layer Qwen3.6-35B-A3B-shape shard directory (Q4_K experts): "
        f"256 slabs, {held / MIB:.0f} MiB of slab bytes. Goal: RSS <= slab bytes + 150 MiB = {bound:.0f} MiB, "
        "serving within 1 s of start.",
        "",
        "| tree | start to serving | its CPU time | first answer | every slab verified and ready | RSS idle | "
        "anonymous | file pages | torch mapped | RSS - slab bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, runs in trees.items():
        rss = med(runs, "rss_mib")
        lines.append(
            f"| {name} | {med(runs, 'serving_s'):.2f} s | {med(runs, 'cpu_s'):.2f} s | {med(runs, 'answer_s'):.2f} s "
            f"| {med(runs, 'prepared_s'):.2f} s | {rss:.0f} MiB | {med(runs, 'anon_mib'):.0f} MiB | "
            f"{med(runs, 'file_mib'):.0f} MiB | {'yes' if med(runs, 'torch') else 'no'} | "
            f"{rss - held / MIB:+.0f} MiB |"
        )
    lines += [
        "",
        "Q4_K slabs are multiplied as ggml's repacked copies on x86 (anonymous memory that takes the slab "
        "pages' place), so the slab bytes show up as anonymous pages there and as file pages for types "
        "multiplied in place. Start to serving: from the process's start to its ready file; its CPU time: the "
        "node process's user + system seconds at that moment (what the start costs a core, whatever the "
        "machine's load); first answer: a Compute call of one row sent as soon as it serves; every slab "
        "verified and ready: its ready file's `prepared` (the tree that hashes and repacks before serving "
        "has done so when it serves).",
    ]
    return "\n".join(lines)


def rev(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", type=Path, required=True, help="a base checkout with its own .venv")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=Path("/work/bench-models/decode"))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    here = Path(__file__).resolve().parent.parent
    _, shard_dir = prepare("qwen35moe", 4, args.workdir)
    pythons = {"before": args.base / ".venv" / "bin" / "python", "after": Path(sys.executable)}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in pythons}
    with tempfile.TemporaryDirectory() as tmp:
        for python in pythons.values():
            one_run(python, shard_dir, Path(tmp))  # cold page cache: not counted
        for _ in range(args.reps):
            for name, python in pythons.items():
                r = one_run(python, shard_dir, Path(tmp))
                runs[name].append(r)
                print(name, json.dumps({k: round(v, 3) for k, v in r.items()}), flush=True)
    cmd = "python bench/node_idle.py --base " + str(args.base) + f" --reps {args.reps}"
    text = render(runs, slab_bytes(shard_dir), cmd, rev(args.base), rev(here))
    print(text)
    if not args.no_write:
        replace_section("node-idle", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
