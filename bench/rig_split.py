"""The swarm against llama.cpp on devices with their own CPU (bench/_rig.py): one split of devices, a few caps.

    sudo .venv/bin/python bench/rig_split.py [--layers 4] [--caps 1200,600] [--rtts 5] [--no-write]

The split (issue 48's first one): the coordinator's device pinned to --coordinator-cpus (core 0) with the cap;
--nodes node devices sharing --node-cpus (core 1), each --node-share of it by CFS quota and --node-cap of memory,
every node behind the delaying relay at each --rtts round trip (the relay on a device of its own: all cores by
quota, outranking other work). llama.cpp (llama-bench, `--repack 0`, mmap,
1 thread) runs alone on the coordinator's device (same core, same cap), the file read from a loop device with a
phone's read-ahead (--read-ahead-kb) and from this VM's own disk. The swarm runs `swarm run --audit 0
--threads 1` on the coordinator's device. Model: bench/_models.py's (the 35B layer shape, Q4_K experts, Q8_0 dense).

The machine's other work is not stopped: a device's CPU is its quota or its core, but other processes may run on
the same cores (the devices' weight outranks theirs; the memory bus and caches are shared).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import command, machine, publish  # noqa: E402
from _fits_groups import MiB, read_ahead_kb  # noqa: E402
from _fits_llama import Phase, llama_phase  # noqa: E402
from _fits_swarm import CappedSwarm, SwarmRun  # noqa: E402
from _llama import DEFAULT_BUILD, llama_version  # noqa: E402
from _models import PROMPT, prepare  # noqa: E402
from _rig import DeviceSpec, Rig  # noqa: E402


@dataclass
class AtCap:
    """One coordinator cap: llama.cpp's prompt and decode under each read-ahead, the swarm's runs per rtt."""

    cap: int
    llama: dict[int, tuple[Phase, Phase]] = field(default_factory=dict)  # read-ahead KiB -> (prompt, decode)
    swarm: dict[float, list[SwarmRun]] = field(default_factory=dict)
    node_peaks: list[int] = field(default_factory=list)


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def measure(args: argparse.Namespace, rig: Rig) -> tuple[list[AtCap], dict[str, object]]:
    gguf, shard = prepare("qwen35moe", args.layers, args.workdir, args.experts, args.vocab, args.dense_type)
    files = {read_ahead_kb(gguf): gguf}
    if args.read_ahead_kb:
        copy = rig.loop_image(gguf, args.read_ahead_kb, args.workdir)
        files[read_ahead_kb(copy)] = copy
    prompt = " ".join(PROMPT.split()[: max(1, args.prompt_tokens * 2 // 3)])
    bench = args.llama_build / "llama-bench"
    made = iter(range(1_000_000))

    def coordinator_device(cap: int) -> object:
        return rig.device(DeviceSpec(f"coord{next(made)}", cpus=args.coordinator_cpus, memory=cap))

    def node_devices() -> list[object]:
        return [
            rig.device(
                DeviceSpec(
                    f"node{next(made)}", cpus=args.node_cpus, cpu_share=args.node_share, memory=args.node_cap
                )
            )
            for _ in range(args.nodes)
        ]

    # the relay stands for the network, not for a device: all the machine's cores, outranking other work
    relay_device = rig.device(DeviceSpec("relay", cpu_share=float(os.cpu_count() or 1)))
    results = []
    load: dict[str, object] = {"before": os.getloadavg()}
    for cap in args.caps:
        at = AtCap(cap)
        for ra, file in files.items() if not args.swarm_only else ():
            pp = llama_phase(
                bench,
                file,
                1,
                cap,
                args.prompt_tokens,
                0,
                False,
                reps=args.reps,
                device=coordinator_device(cap),
            )
            tg = llama_phase(
                bench,
                file,
                1,
                cap,
                0,
                args.decode_tokens,
                False,
                reps=args.reps,
                device=coordinator_device(cap),
            )
            at.llama[ra] = (pp, tg)
            print(f"llama {cap // MiB} MiB, read-ahead {ra} KiB: {pp} / {tg}", file=sys.stderr, flush=True)
        swarm = CappedSwarm(
            shard,
            cap,
            args.nodes,
            args.workdir / "nodes",
            devices=node_devices(),
            coordinator=functools.partial(coordinator_device, cap),
            relay_device=relay_device,
        )
        try:
            print(f"  warm-up: {swarm.run(0, prompt, args.decode_tokens, 1)}", file=sys.stderr, flush=True)
            for rep in range(args.reps):
                for rtt in args.rtts:
                    drafts = (args.drafts, args.draft_wrong, rep) if args.drafts else None  # other draws a rep
                    run = swarm.run(rtt, prompt, args.decode_tokens, 1, drafts=drafts)
                    at.swarm.setdefault(rtt, []).append(run)
                    print(
                        f"swarm {cap // MiB} MiB, rtt {rtt} ms, rep {rep}: {run}", file=sys.stderr, flush=True
                    )
            at.node_peaks = swarm.peaks()
        finally:
            swarm.close()  # the nodes and their devices: the next cap starts afresh
        results.append(at)
    load["after"] = os.getloadavg()
    return results, load


def _f(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def report(
    args: argparse.Namespace, results: list[AtCap], load: dict[str, object], took: float, cmd: str
) -> str:
    lines = [
        f"{machine()}; {took / 60:.0f} min. Command: `{cmd}`. llama.cpp: "
        f"{'not run' if args.swarm_only else llama_version(args.llama_build / 'llama-bench')}.",
        "",
        f"Split: coordinator device = cpuset {args.coordinator_cpus} + the cap; {args.nodes} node devices on cpuset "
        f"{args.node_cpus}, {args.node_share:g} of it each by CFS quota (10 ms period), {args.node_cap // MiB} MiB each; "
        f"{args.layers} layers of the 35B shape ({args.experts or 256} experts a layer, Q4_K experts, "
        f"{args.dense_type} dense{f', vocabulary {args.vocab:,}' if args.vocab else ''}). Median of {args.reps}; tok/s.",
        _quiet(load),
        "",
        "| coordinator cap | engine | prompt tok/s | decode tok/s | decode, swarm / llama.cpp | peak memory, MiB |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for at in results:
        for ra, (pp, tg) in sorted(at.llama.items()):
            why = f" ({tg.why or pp.why})" if tg.why or pp.why else ""
            lines.append(
                f"| {at.cap // MiB:,} MiB | llama.cpp, read-ahead {ra:,} KiB{why} | {_f(pp.tps)} | {_f(tg.tps)} | | "
                f"{max(pp.peak, tg.peak) // MiB:,} |"
            )
        for rtt, runs in sorted(at.swarm.items()):
            spp = _median([r.prompt_tps for r in runs if r.prompt_tps])
            stg = _median([r.decode_tps for r in runs if r.decode_tps])
            ratios = ", ".join(
                f"{stg / tg.tps:.2f}x ({ra:,} KiB)"
                for ra, (_, tg) in sorted(at.llama.items())
                if stg and tg.tps
            )
            late = _median([r.late_ms for r in runs if r.decode_tps])
            failed = [r.why for r in runs if r.decode_tps is None]
            what = f"swarm, {rtt:g} ms relay (+{late or 0:.1f} ms late)" + (
                f", failed: {failed[0]}" if failed else ""
            )
            peaks = ", ".join(f"{x // MiB:,}" for x in at.node_peaks)
            coord = max(r.peak for r in runs) // MiB
            if args.drafts:  # the same engine's run without drafts, then the drafted one
                utg = _median([r.undrafted_tps for r in runs if r.undrafted_tps])
                uratios = ", ".join(
                    f"{utg / tg.tps:.2f}x ({ra:,} KiB)" for ra, (_, tg) in sorted(at.llama.items()) if utg and tg.tps
                )
                lines.append(f"| {at.cap // MiB:,} MiB | {what}, no drafts | | {_f(utg)} | {uratios} | |")
                made = sum(r.drafts_made for r in runs)
                kept = sum(r.drafts_kept for r in runs)
                what += (f", {args.drafts} drafts a pass, each wrong with p {args.draft_wrong:g} "
                         f"({kept:,} of {made:,} kept)")  # fmt: skip
            lines.append(
                f"| {at.cap // MiB:,} MiB | {what} | {_f(spp)} | {_f(stg)} | {ratios} | coordinator {coord:,}; nodes {peaks} |"
            )
    return "\n".join(lines)


def _quiet(load: dict[str, object]) -> str:
    """Whether the machine was left to the bench: its 5-minute load average before and after."""
    before, after = load["before"][1], load["after"][1]  # type: ignore[index]
    said = f"load average {before:.1f} before, {after:.1f} after, 5-min"
    busy = max(before, after) > 0.75 * (os.cpu_count() or 1) + 1.0  # the bench's own devices count too
    if busy:
        return f"**A smoke test, not the issue's answer:** the machine's cores were shared with other work ({said})."
    return f"Nothing else ran on the machine ({said}; the bench's own processes count in it)."


def _mib_list(text: str) -> list[int]:
    return [int(float(x) * MiB) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=None, help="experts a layer (default: the preset's 256)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the synth's small one)")
    p.add_argument("--dense-type", default="Q8_0", help="the dense tensors' type (Q4_K_M: llama.cpp's mixture)")
    p.add_argument("--caps", type=_mib_list, default=_mib_list("1200,600"), help="coordinator caps, MiB")
    p.add_argument(
        "--rtts", type=lambda t: [float(x) for x in t.split(",")], default=[5.0], help="ms (0: direct)"
    )
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--node-cap", type=lambda t: int(float(t) * MiB), default=900 * MiB, help="MiB")
    p.add_argument(
        "--node-share", type=float, default=0.25, help="cores of --node-cpus each node gets by quota"
    )
    p.add_argument("--coordinator-cpus", default="0")
    p.add_argument("--node-cpus", default="1")
    p.add_argument(
        "--read-ahead-kb", type=int, default=128, help="llama.cpp's file on a loop device (0: not)"
    )
    p.add_argument("--drafts", type=int, default=0, help="drafts a pass, scripted from the undrafted text (0: none)")
    p.add_argument("--draft-wrong", type=float, default=0.18, help="the chance each draft is wrong (MTP's published "
                   "rate on Qwen3.6-35B keeps ~0.82)")  # fmt: skip
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path("/work/bench-models/rig"))
    p.add_argument("--llama-build", type=Path, default=DEFAULT_BUILD)
    p.add_argument("--swarm-only", action="store_true", help="the swarm's side only (a trial)")
    p.add_argument("--no-write", action="store_true", help="print instead of writing docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    if not args.swarm_only and not (args.llama_build / "llama-bench").exists():
        raise SystemExit(f"no llama-bench in {args.llama_build}: deploy/build-llama-cpp.sh builds it")
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with Rig() as rig:
        results, load = measure(args, rig)
    section = "rig_split" if args.layers == 4 and not (args.experts or args.vocab) else (
        f"rig_split-{args.layers}l-{args.dense_type.lower().replace('_', '')}"
    ) + (f"-drafts{args.drafts}" if args.drafts else "") + (
        "" if args.layers == 4 else "-cap" + "-".join(str(c // MiB) for c in args.caps)
    )
    publish(
        section,
        report(args, results, load, time.monotonic() - t0, command("rig_split.py", argv)),
        not args.no_write,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
