"""A model no single device holds: llama.cpp on one capped device against the swarm on devices so capped.

    sudo .venv/bin/python bench/fits.py [--caps 1200,900,600] [--rtts 0,2,5] [--reps 3] [--workdir DIR]

(about 25 min: llama.cpp's side 19, the swarm's 6; `--llama-from-last` runs the swarm's side again with the
llama.cpp figures the last full run kept in --workdir.)

Model: `swarm synth` at the Qwen3.6-35B-A3B layer shape (Q4_K experts, Q8_0 dense; bench/_models.py) with
enough layers that the file is ~2.5x the middle cap. Every "device" is a cgroup v1 memory group with that
cap (page cache counts against it: a process's memory-mapped file pages are evicted under the cap and read
again from disk at their next use; anonymous memory is never evicted, there is no swap), each with a blkio
group beside it that counts the bytes its processes read from disk.

- llama.cpp (llama-bench, `--repack 0`, mmap on) on one capped device: the pp and the tg test each in a
  process of its own, so that each one's disk reads are its own; a one-token tg process gives what the load
  reads, so that the bytes one decode token reads are measured. `--repack 1` (its default) is tried at the
  largest cap; uncapped runs of both are the ceiling and say how much memory llama.cpp needs to be uncapped.
  Capped runs twice: the file on this VM's disk (8 MiB read-ahead: a page fault reads that much around it)
  and a copy on a loop device with a phone's 128 KiB (bench/_fits_readahead.py); more caps, decode only,
  place where llama.cpp catches up with the swarm.
- The swarm: as many nodes as the cap needs to keep every expert resident (each node sizes its copies to
  its cap itself: `--memory` defaults to the cgroup's limit less its own baseline and a margin), each on a
  device of that cap, and `swarm run --audit 0` on one more (one run with its default answer checks);
  over loopback, and through bench/_relay.py adding 2 and 5 ms of round trip on every connection, gRPC
  and compute stream both (the relay's byte counts show that every node's stream crossed it).
- The disk's direct-I/O random-read speed (O_DIRECT, queue depth 1, 4 KiB, 128 KiB and 1 MiB), and what
  llama.cpp's capped figures would be on a phone's flash (the assumption is in the section).

Each process's peak memory is its group's memory.max_usage_in_bytes (anonymous memory and page cache). Figures
go to the `bench:fits` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import command, machine, publish  # noqa: E402
from _fits_groups import BLOCKS, MiB, check_groups, direct_read_speed, read_ahead_kb  # noqa: E402
from _fits_llama import LlamaCapped, Phase, llama_capped, llama_phase  # noqa: E402
from _fits_readahead import readahead_copy  # noqa: E402
from _fits_report import report  # noqa: E402
from _fits_swarm import MMAP_TUNABLES, CappedSwarm, SwarmRun, nodes_needed  # noqa: E402
from _llama import DEFAULT_BUILD, llama_version  # noqa: E402
from _models import PROMPT, prepare  # noqa: E402
from _relay import measured_rtt_ms  # noqa: E402


@dataclass
class CapFigures:
    """The swarm at one cap."""

    limit: int
    n_nodes: int = 0
    swarm: dict[float, list[SwarmRun]] = field(default_factory=dict)  # by added round trip, ms
    node_peaks: list[int] = field(default_factory=list)
    node_anon: list[int] = field(default_factory=list)  # after the runs
    warm_reads: int | None = None  # bytes the nodes read from disk in the untimed first run (copies made)
    node_reads: int | None = None  # ... and during the timed runs after it
    warm: SwarmRun | None = None
    audited: SwarmRun | None = None  # loopback with the default answer checks (at the largest cap)
    node_kills: int = 0
    nodes_alive: bool = True
    why: str = ""  # why there are no runs (the nodes did not start)


@dataclass
class Figures:
    """One bench run."""

    gguf: Path
    file_bytes: int
    expert_bytes: int
    layers: int
    disk: dict[str, dict[int, float]]  # where ("this VM's disk", "loop device") -> block size -> bytes/s
    read_aheads: dict[int, str]  # read-ahead, KiB -> where the file lay
    rtts: dict[float, float]  # relay setting -> measured ping, ms
    uncapped: dict[str, LlamaCapped]  # "repack" / "no repack"
    repack_capped: Phase | None
    llama: dict[tuple[int, int], LlamaCapped]  # (read-ahead KiB, cap) -> llama.cpp, no repack
    cross: dict[tuple[int, int], Phase]  # (read-ahead KiB, cap) -> decode at the caps that place the crossing
    caps: list[CapFigures]
    n_prompt: int
    n_decode: int
    llama_version: str
    threads: int
    reps: int
    tunables: str
    # side -> the machine's 5-minute load average after it
    load: dict[str, float] = field(default_factory=dict)
    note: str = ""  # where the llama.cpp side comes from, when not from this run


def _swarm_at(
    fig: CapFigures, shard: Path, args: argparse.Namespace, audited: bool, prompt: str, work: Path
) -> None:
    """The swarm's runs at one cap, every round trip in each repetition (rotated: none always runs first);
    `audited`: one more over loopback with the coordinator's default answer checks."""
    rtts, n_decode = args.rtts, args.decode_tokens
    fig.n_nodes = nodes_needed(shard, fig.limit)
    print(f"swarm: {fig.n_nodes} nodes under {fig.limit / MiB:,.0f} MiB", file=sys.stderr, flush=True)
    try:
        swarm = CappedSwarm(
            shard, fig.limit, fig.n_nodes, work / f"nodes-{fig.limit // MiB}", args.node_tunables
        )
    except (RuntimeError, TimeoutError, OSError) as e:
        fig.why = f"the nodes did not start: {e}"[:300]
        print(f"  {fig.why}", file=sys.stderr, flush=True)
        return
    try:
        # the first run after the nodes start makes their copies of the experts it routes to (reading
        # their slabs); it is not timed, as llama-bench's own warm-up run is not
        read0 = swarm.disk_reads()
        fig.warm = swarm.run(0, prompt, n_decode, args.threads)
        print(f"  warm-up: {fig.warm}", file=sys.stderr, flush=True)
        read1 = swarm.disk_reads()
        fig.warm_reads = None if read0 is None or read1 is None else read1 - read0
        for rep in range(args.reps):
            for rtt in rtts[rep % len(rtts) :] + rtts[: rep % len(rtts)]:
                run = swarm.run(rtt, prompt, n_decode, args.threads)
                fig.swarm.setdefault(rtt, []).append(run)
                print(f"  rtt {rtt} ms: {run}", file=sys.stderr, flush=True)
        read2 = swarm.disk_reads()
        fig.node_reads = None if read1 is None or read2 is None else read2 - read1
        if audited:
            fig.audited = swarm.run(0, prompt, n_decode, args.threads, audit=True)
            print(f"  audited: {fig.audited}", file=sys.stderr, flush=True)
        fig.node_peaks = swarm.peaks()
        fig.node_anon = swarm.anon()
        fig.node_kills = swarm.oom_kills()
        fig.nodes_alive = swarm.alive()
    finally:
        swarm.close()


def _llama_side(args: argparse.Namespace, gguf: Path, figs: dict[str, object]) -> None:
    """llama.cpp uncapped, and capped under each read-ahead (this VM's disk, and a loop device's)."""
    bench = args.llama_build / "llama-bench"
    t, p, n, r = args.threads, args.prompt_tokens, args.decode_tokens, args.llama_reps
    caps = sorted(args.caps, reverse=True)
    figs["uncapped"] = {
        "repack": llama_capped(bench, gguf, t, None, p, n, repack=True, reps=r),
        "no repack": llama_capped(bench, gguf, t, None, p, n, repack=False, reps=r),
    }
    print(f"llama uncapped: {figs['uncapped']}", file=sys.stderr, flush=True)
    figs["repack_capped"] = llama_phase(bench, gguf, t, caps[0], p, 0, repack=True)
    llama: dict[tuple[int, int], LlamaCapped] = {}
    cross: dict[tuple[int, int], Phase] = {}
    read_aheads = {read_ahead_kb(gguf): "this VM's disk"}

    def capped(file: Path, ra: int) -> None:
        for limit in caps:
            llama[ra, limit] = llama_capped(bench, file, t, limit, p, n, repack=False, reps=r)
            print(f"llama, read-ahead {ra} KiB, {limit / MiB:,.0f} MiB: {llama[ra, limit]}", file=sys.stderr)
        for limit in sorted(args.cross_caps):
            cross[ra, limit] = llama_phase(bench, file, t, limit, 0, n, repack=False, reps=r)
            print(
                f"llama decode, read-ahead {ra} KiB, {limit / MiB:,.0f} MiB: {cross[ra, limit]}",
                file=sys.stderr,
            )

    capped(gguf, read_ahead_kb(gguf))
    if args.read_ahead_kb:
        with readahead_copy(gguf, args.workdir, args.read_ahead_kb) as copy:
            read_aheads[read_ahead_kb(copy)] = f"a loop device ({read_ahead_kb(copy):,} KiB read-ahead)"
            capped(copy, read_ahead_kb(copy))
    figs.update(llama=llama, cross=cross, read_aheads=read_aheads)


def _disk(args: argparse.Namespace, gguf: Path) -> dict[str, dict[int, float]]:
    """The direct-I/O random-read speed of this VM's disk and of the loop device's copy."""
    disk = {"this VM's disk": {b: direct_read_speed(gguf, b) for b in BLOCKS}}
    if args.read_ahead_kb:
        with readahead_copy(gguf, args.workdir, args.read_ahead_kb) as copy:
            disk[f"the loop device ({read_ahead_kb(copy):,} KiB read-ahead)"] = {
                b: direct_read_speed(copy, b) for b in BLOCKS
            }
    print(f"disk {disk}", file=sys.stderr, flush=True)
    return disk


def measure(args: argparse.Namespace) -> Figures:
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    gguf, shard = prepare("qwen35moe", args.layers, work)
    p = args.prompt_tokens
    prompt = " ".join(PROMPT.split()[: max(1, p * 2 // 3)])  # about p tokens of the synth tokenizer
    rtts = {r: measured_rtt_ms(r) for r in args.rtts if r}
    print(f"relay {rtts}", file=sys.stderr, flush=True)
    side: dict[str, object] = dict(read_aheads={}, uncapped={}, repack_capped=None, llama={}, cross={})
    load = {}  # the machine is shared: how busy it was beside each side
    saved = work / "llama-side.pickle"  # the llama.cpp side of the last run that made one
    if args.llama_from_last:
        side, load, when = pickle.loads(saved.read_bytes())
        side["note"] = f"llama.cpp's rows: the run of {when} (this command without --llama-from-last)"
    elif not args.swarm_only:
        _llama_side(args, gguf, side)
        load["llama.cpp"] = os.getloadavg()[1]
        saved.write_bytes(pickle.dumps((side, load, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))))
    disk = _disk(args, gguf)
    caps = sorted(args.caps, reverse=True)
    figs = []
    if not args.llama_only:
        for limit in caps:
            fig = CapFigures(limit)
            _swarm_at(fig, shard, args, limit == caps[0], prompt, work)
            figs.append(fig)
        load["swarm"] = os.getloadavg()[1]
    return Figures(
        gguf=gguf,
        file_bytes=gguf.stat().st_size,
        expert_bytes=sum(f.stat().st_size for f in (shard / "experts").rglob("*") if f.is_file()),
        layers=args.layers,
        disk=disk,
        rtts=rtts,
        caps=figs,
        n_prompt=p,
        n_decode=args.decode_tokens,
        llama_version=llama_version(args.llama_build / "llama-bench"),
        threads=args.threads,
        reps=args.reps,
        tunables=args.node_tunables,
        load=load,
        **side,  # type: ignore[arg-type]
    )


def _mib_list(text: str) -> list[int]:
    try:
        return [int(float(x) * MiB) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give MiB, comma-separated, e.g. 1200,900,600") from None


def _ms_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give milliseconds, comma-separated, e.g. 0,2,5"
        ) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--caps", type=_mib_list, default=_mib_list("1200,900,600"), help="device caps, MiB")
    p.add_argument("--rtts", type=_ms_list, default=_ms_list("0,2,5"), help="added round trips, ms (0: none)")
    p.add_argument("--layers", type=int, default=5, help="model layers (5: a 2.3 GiB file)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="llama-bench's pp test")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads of llama-bench and of the coordinator (nodes: 1 each); ggml's threads wait for each "
        "other at every matmul, and where other processes share the cores 2 of them collapse (llama-bench "
        "decoding the 4-layer file: 3.1 tok/s with 2, 25.8 with 1)",
    )
    p.add_argument("--reps", type=int, default=3, help="swarm runs per cap and round trip (median)")
    p.add_argument("--llama-reps", type=int, default=3, help="llama-bench -r (median of its repetitions)")
    p.add_argument(
        "--read-ahead-kb",
        type=int,
        default=128,
        help="llama.cpp capped again with the file on a loop device of this read-ahead (0: not)",
    )
    p.add_argument(
        "--node-tunables",
        default="",
        help=f"GLIBC_TUNABLES for the nodes (e.g. {MMAP_TUNABLES}; default: the nodes' own heap settings)",
    )
    only = p.add_mutually_exclusive_group()
    only.add_argument("--llama-only", action="store_true", help="llama.cpp's side only (a trial)")
    only.add_argument("--swarm-only", action="store_true", help="the swarm's side only (a trial)")
    only.add_argument(
        "--llama-from-last",
        action="store_true",
        help="the swarm's side, with llama.cpp's figures from the last run that measured them (kept in --workdir)",
    )
    p.add_argument(
        "--cross-caps",
        type=_mib_list,
        default=_mib_list("1600,2000,2200"),
        help="more caps, MiB, for llama.cpp's decode alone: where it meets the swarm",
    )
    p.add_argument("--workdir", type=Path, default=Path("/work/bench-models/fits"))
    p.add_argument("--llama-build", type=Path, default=DEFAULT_BUILD, help="llama.cpp's build/bin")
    p.add_argument("--no-write", action="store_true", help="print instead of writing docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    check_groups()
    if not (args.llama_build / "llama-bench").exists():
        raise SystemExit(f"no llama-bench in {args.llama_build}: build llama.cpp first (docs/BENCHMARKS.md)")
    t0 = time.monotonic()
    figs = measure(args)
    (args.workdir / "figures.pickle").write_bytes(pickle.dumps(figs))  # to render the section again
    text = report(figs, command("fits.py", argv), machine(), time.monotonic() - t0)
    publish("fits", text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
