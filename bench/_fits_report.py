"""The `bench:fits` section: bench/fits.py's figures as tables, the phone projection, the goal, the cross."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from _fits_groups import MiB
from _fits_llama import LlamaCapped, Phase

if TYPE_CHECKING:
    from fits import CapFigures, Figures

# A phone's flash (the assumption): UFS 3.1, as in most 2021-2024 flagship and mid-range phones, as a read
# at queue depth 1 costing a fixed latency plus its bytes at the sequential speed (vendors rate reads at
# ~2.1 GB/s; 4 KiB random reads at queue depth 1 run at ~40 MB/s, ~10k IOPS).
PHONE_LATENCY = 100e-6  # s per read
PHONE_BANDWIDTH = 2.0e9  # bytes/s
GOAL = 3.0  # the swarm at 5 ms against llama.cpp's best capped decode
K, N_EXPERT = 8, 256  # the 35B shape's experts a token uses, and a layer's experts


def phone_speed(block: int) -> float:
    """Random reads of `block` bytes at queue depth 1 on the assumed phone flash, bytes/s."""
    return block / (PHONE_LATENCY + block / PHONE_BANDWIDTH)


def _block(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _tps(x: float | None) -> str:
    return f"{x:,.1f}" if x is not None else "-"


def _mib(n: float | None) -> str:
    return f"{n / MiB:,.0f} MiB" if n is not None else "-"


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _phase(p: Phase) -> str:
    return _tps(p.tps) if p.tps is not None else f"none ({p.why})"


def swarm_tps(fig: CapFigures, rtt: float) -> tuple[float | None, float | None]:
    runs = fig.swarm.get(rtt, [])
    return _median([r.prompt_tps for r in runs]), _median([r.decode_tps for r in runs])


def _phone(run: LlamaCapped, ra_kb: int, base: LlamaCapped) -> float | None:
    """llama.cpp's capped decode on the phone's flash: the uncapped no-repack step (this machine's compute)
    plus the bytes a decode token read here, in reads of the read-ahead's size."""
    if run.read_per_token is None or base.decode.tps is None:
        return None
    return 1.0 / (1.0 / base.decode.tps + run.read_per_token / phone_speed(ra_kb << 10))


def routed_bytes(figs: Figures) -> float:
    """The expert bytes one decode token routes to: K experts of every layer."""
    return K * figs.expert_bytes / N_EXPERT


def _llama_table(figs: Figures) -> list[str]:
    if not figs.uncapped:
        return ["(llama.cpp not run)"]
    base = figs.uncapped["no repack"]
    lines = [
        "| llama.cpp, one device | read-ahead | prompt tok/s | decode tok/s | peak memory | disk read / decode "
        "token | decode at phone flash (projected) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, run in figs.uncapped.items():
        lines.append(f"| uncapped, {name} | - | {_phase(run.prompt)} | {_phase(run.decode)} | {_mib(run.peak)} "
                     f"| {_mib(run.read_per_token)} | - |")  # fmt: skip
    for (ra, cap), run in sorted(figs.llama.items(), key=lambda x: (-x[0][0], -x[0][1])):
        lines.append(f"| cap {_mib(cap)} | {ra:,} KiB | {_phase(run.prompt)} | {_phase(run.decode)} | "
                     f"{_mib(run.peak)} | {_mib(run.read_per_token)} | {_tps(_phone(run, ra, base))} |")  # fmt: skip
    for (ra, cap), p in sorted(figs.cross.items(), key=lambda x: (-x[0][0], x[0][1])):
        lines.append(
            f"| cap {_mib(cap)} (decode only) | {ra:,} KiB | - | {_phase(p)} | {_mib(p.peak)} | - | - |"
        )
    if figs.repack_capped is not None:
        r = figs.repack_capped
        cap = _mib(max(c for _, c in figs.llama))
        lines.append(f"| cap {cap}, `--repack 1` (its default) | 8,192 KiB | {_phase(r)} | - | {_mib(r.peak)} "
                     "| - | - |")  # fmt: skip
    return lines


def _relayed(fig: CapFigures, rtt: float) -> str:
    runs = [r for r in fig.swarm.get(rtt, []) if r.decode_tps is not None]
    if not rtt or not runs:
        return "-"
    stream = statistics.median(r.stream_bytes for r in runs)
    grpc = statistics.median(r.grpc_bytes for r in runs)
    late = statistics.median(r.late_ms for r in runs)
    return f"{stream / 1e6:,.1f} / {grpc / 1e6:,.2f} MB, +{late:.2f} ms"


def _swarm_table(figs: Figures, rtts: list[float]) -> list[str]:
    head = " / ".join(f"{'loopback' if not r else f'{r:g} ms'}" for r in rtts)
    relayed = " / ".join(f"{r:g} ms" for r in rtts if r)
    lines = [
        f"| swarm, cap on every device | nodes | prompt tok/s ({head}) | decode tok/s ({head}) | node peak "
        "(largest) | node anonymous memory after (largest) | node disk reads: warm-up run / timed runs | coordinator "
        f"peak | relay, a run's stream / gRPC bytes, chunks' lateness ({relayed}) | OOM kills |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for fig in figs.caps:
        if fig.why:
            lines.append(f"| cap {_mib(fig.limit)} | {fig.n_nodes} | {fig.why} | | | | | | | |")
            continue
        prompts = " / ".join(_tps(swarm_tps(fig, r)[0]) for r in rtts)
        decodes = " / ".join(_tps(swarm_tps(fig, r)[1]) for r in rtts)
        coord = max((run.peak for runs in fig.swarm.values() for run in runs), default=0)
        fails = sorted({run.why for runs in fig.swarm.values() for run in runs if run.why})
        kills = (
            f"{fig.node_kills}"
            + ("" if fig.nodes_alive else ", a node died")
            + "".join(f"; {w}" for w in fails)
        )
        relay = "; ".join(_relayed(fig, r) for r in rtts if r)
        lines.append(f"| cap {_mib(fig.limit)} | {fig.n_nodes} | {prompts} | {decodes} | "
                     f"{_mib(max(fig.node_peaks, default=0))} | {_mib(max(fig.node_anon, default=0))} | "
                     f"{_mib(fig.warm_reads)} / {_mib(fig.node_reads)} | {_mib(coord)} | {relay} | {kills} |")  # fmt: skip
    return lines


def _swarm_prompt(figs: Figures) -> str:
    counts = {
        run.prompt_tokens for f in figs.caps for runs in f.swarm.values() for run in runs if run.prompt_tokens
    }
    return ", ".join(str(c) for c in sorted(counts)) or "-"


def _audited(figs: Figures) -> str:
    """The loopback run with the coordinator's default answer checks, where the bench made one."""
    for fig in figs.caps:
        run = fig.audited
        if run is None:
            continue
        if run.decode_tps is None:
            return f"at {_mib(fig.limit)}: no figure ({run.why}; its group's peak {_mib(run.peak)})"
        return (f"at {_mib(fig.limit)}: prompt {_tps(run.prompt_tps)}, decode {_tps(run.decode_tps)} tok/s, "
                f"coordinator peak {_mib(run.peak)}")  # fmt: skip
    return "not run"


def _curve(figs: Figures, ra: int) -> list[tuple[float, float]]:
    """llama.cpp's decode against the cap under one read-ahead, ending with the memory it takes uncapped."""
    points = [(float(c), run.decode.tps or 0.0) for (r, c), run in figs.llama.items() if r == ra]
    points += [(float(c), p.tps or 0.0) for (r, c), p in figs.cross.items() if r == ra]
    base = figs.uncapped.get("no repack")
    if base is not None and base.decode.tps is not None:
        points.append((float(base.peak), base.decode.tps))
    return sorted(points)


def crossing(points: list[tuple[float, float]], target: float) -> float | None:
    """The cap where a rising curve first reaches `target` (linear between measured points; None: never)."""
    if points and points[0][1] >= target:
        return points[0][0]
    for (c0, v0), (c1, v1) in zip(points, points[1:], strict=False):
        if v1 >= target > v0:
            return c0 + (target - v0) / (v1 - v0) * (c1 - c0)
    return None


def _cross(figs: Figures, name: str, swarm_decode: float | None) -> str:
    if swarm_decode is None:
        return f"no swarm figure {name}."
    parts = []
    for ra in sorted(figs.read_aheads, reverse=True):
        pts = _curve(figs, ra)
        at = crossing(pts, swarm_decode)
        parts.append(
            f"{ra:,} KiB read-ahead: never (its uncapped no-repack decode here is {pts[-1][1]:,.1f})"
            if at is None and pts
            else f"{ra:,} KiB read-ahead: -"
            if at is None
            else f"{ra:,} KiB read-ahead: at a cap of about {_mib(at)} ({at / figs.file_bytes:.2f}x the file)"
        )
    return (
        f"llama.cpp's decode reaches the swarm's {swarm_decode:,.1f} tok/s {name}: " + "; ".join(parts) + "."
    )


def vm_disk_projection(figs: Figures) -> float | None:
    """llama.cpp's best capped decode had the small read-ahead's reads run at this VM disk's own speed for
    reads of that size (the loop device's path is slower): the uncapped step plus the bytes a token read."""
    base = figs.uncapped.get("no repack")
    vm = figs.disk.get("this VM's disk", {})
    best = None
    for (ra, _), run in figs.llama.items():
        speed = vm.get(ra << 10)
        if base is None or not base.decode.tps or not speed or run.read_per_token is None:
            continue
        tps = 1.0 / (1.0 / base.decode.tps + run.read_per_token / speed)
        best = tps if best is None else max(best, tps)
    return best


def goal(figs: Figures) -> tuple[float, list[tuple[int, float | None]], bool]:
    """llama.cpp's best capped decode (any read-ahead, the bench's caps), the swarm's 5 ms decode at each
    cap, and whether every one of them is GOAL times the best."""
    best = max((run.decode.tps or 0.0 for run in figs.llama.values()), default=0.0)
    at5 = [(f.limit, swarm_tps(f, 5.0)[1]) for f in figs.caps]
    met = bool(best) and bool(at5) and all(d is not None and d >= GOAL * best for _, d in at5)
    return best, at5, met


def _why(figs: Figures) -> list[str]:
    """What the figures come from, in the figures' own terms."""
    lines = []
    for ra in sorted(figs.read_aheads, reverse=True):
        runs = [(c, run) for (r, c), run in sorted(figs.llama.items()) if r == ra and run.read_per_token]
        if runs:
            reads = ", ".join(f"{_mib(run.read_per_token)} at {_mib(c)}" for c, run in runs)
            lines.append(f"{ra:,} KiB read-ahead: {reads}")
    llama = (
        f"- **Why llama.cpp slows under a cap:** a decode token uses {K} experts of every layer "
        f"({_mib(routed_bytes(figs))}); the cap holds only part of the file in page cache, so most of them "
        "are read again from disk at their page faults, each fault reading the read-ahead window around it. "
        "A decode token read " + ("; ".join(lines) or "-") + ". Its prompt suffers less: a pass over "
        "many tokens reads each expert once for all of them."
    )
    top = figs.caps[0] if figs.caps else None
    loop, at5 = (swarm_tps(top, 0.0)[1], swarm_tps(top, 5.0)[1]) if top else (None, None)
    per_layer = (1 / at5 - 1 / loop) * 1e3 / figs.layers if loop and at5 else None
    warm = ", ".join(_mib(f.warm_reads) for f in figs.caps)
    reads = ", ".join(_mib(f.node_reads) for f in figs.caps)
    swarm = (
        "- **Why the swarm does not:** each node keeps its experts resident as its own copies (anonymous "
        f"memory within its cap): the nodes read {warm} from disk in the untimed first run at the caps (their "
        f"slabs, once: the copies are made then) and {reads} in the timed runs after it. So a token costs "
        "compute and one round trip a layer to the nodes that hold its experts, in parallel. "
        + (
            f"The 5 ms relay costs {per_layer:.1f} ms a layer a token at the largest cap. "
            if per_layer is not None and per_layer > 0
            else ""
        )
        + f"Both costs grow with the layer count, as the file does: the real model's 40 layers (8x these "
        f"{figs.layers}) on devices with 8x these caps keep the ratios roughly, not the tok/s."
    )
    return [llama, swarm]


def _against_projection(figs: Figures, at5: list[tuple[int, float | None]]) -> str:
    """How far the projection model (the uncapped step plus a token's bytes at the disk's direct-I/O speed,
    which the phone-flash column uses) is from what llama.cpp measured on this VM's disk."""
    vm = vm_disk_projection(figs)
    best = max((run.decode.tps or 0.0 for (ra, _), run in figs.llama.items() if ra == min(figs.read_aheads)),
               default=0.0)  # fmt: skip
    if vm is None or not best:
        return ""
    return (
        f" For scale: the model behind the phone-flash column gives {vm:,.1f} tok/s for llama.cpp's best "
        f"capped decode at this VM disk's own speed, where it measured {best:,.1f}: the kernel's read-ahead "
        "and page faults read faster than one direct read at a time, so that column understates llama.cpp "
        f"by about {best / vm:.1f}x."
    )


def _notes(figs: Figures) -> list[str]:
    base = figs.uncapped.get("no repack")
    phones = []
    for ra in sorted(figs.read_aheads, reverse=True):
        got = [_phone(run, ra, base) for (r, _), run in figs.llama.items() if r == ra and base is not None]
        got_ = [g for g in got if g is not None]
        if got_:
            phones.append(f"{min(got_):,.1f}-{max(got_):,.1f} tok/s at {ra:,} KiB read-ahead")
    devices = ", ".join(f"{f.n_nodes + 1} x {_mib(f.limit)}" for f in figs.caps)
    return [
        "- **Phone flash:** the last column of llama.cpp's table keeps this machine's compute (its uncapped "
        "no-repack step) and adds the bytes a decode token read here, in reads of the read-ahead's size at the "
        f"assumed flash speed: {'; '.join(phones) or '-'}. The swarm's nodes read nothing in the timed runs, "
        "so a phone's flash changes only how long their first run takes.",
        f"- **What differs besides the memory:** the swarm spreads over more devices ({devices}: nodes and "
        "coordinator), llama.cpp runs on one; here all of them share the 2 cores, which on separate devices "
        "they would not. The machine was busy with other work (load above): a cell's runs differ by up to "
        "about 20%, and the two sides ran minutes apart, so the ratios carry that much noise.",
    ]


def _header(figs: Figures, cmd: str, where: str, seconds: float) -> list[str]:
    disks = "; ".join(
        f"{name}: " + ", ".join(f"{_block(b)} {v / 1e6:,.0f} MB/s" for b, v in sorted(speeds.items()))
        for name, speeds in figs.disk.items()
    )
    blocks = sorted({b for speeds in figs.disk.values() for b in speeds})
    phone = ", ".join(f"{_block(b)} {phone_speed(b) / 1e6:,.0f} MB/s" for b in blocks)
    relay = ", ".join(f"{r:g} ms set, {m:.2f} ms measured" for r, m in sorted(figs.rtts.items()))
    return [
        "## A model no single device holds (`bench/fits.py`)",
        "",
        f"Command: `{cmd}` ({seconds / 60:.0f} min)  ",
        f"Machine: {where}. llama.cpp: {figs.llama_version}, llama-bench `-t {figs.threads}`, mmap on, median "
        f"of its repetitions; `swarm run --threads {figs.threads} --audit 0`, nodes `--threads 1`, the median of "
        f"{figs.reps} runs a cell after an untimed one. "
        + (f"{figs.note}. " if figs.note else "")
        + "The machine is shared: its 5-minute load average after each side, "
        + (", ".join(f"{k} {v:.1f}" for k, v in figs.load.items()) or "not taken")
        + " (2 cores; the bench's own processes count in it, other processes' builds and tests too).",
        "",
        f"Model: `swarm synth --like qwen3.6-35b-a3b`, {figs.layers} layers (D 2048, 256 experts of F 512, "
        f"K 8, Q4_K experts, Q8_0 dense): a {_mib(figs.file_bytes)} file, {_mib(figs.expert_bytes)} of "
        f"experts ({_mib(routed_bytes(figs))} of them routed to by one token). Prompt {figs.n_prompt} tokens "
        f"(llama-bench pp; `swarm run`: {_swarm_prompt(figs)} tokens of the bench prompt), {figs.n_decode} "
        "decode tokens. Every device is a cgroup v1 memory group (page cache counts against its cap); peak "
        "memory is its memory.max_usage_in_bytes, disk reads its blkio group's. Disk, O_DIRECT random reads "
        f"at queue depth 1: {disks}. Assumed phone flash (UFS 3.1 class, {PHONE_LATENCY * 1e6:.0f} µs a read "
        f"plus {PHONE_BANDWIDTH / 1e9:.1f} GB/s): {phone}. Relay: {relay or 'not used'}.",
    ]


def report(figs: Figures, cmd: str, where: str, seconds: float) -> str:
    rtts = sorted({r for f in figs.caps for r in f.swarm})
    best, at5, met = goal(figs)
    ratios = ", ".join(
        f"{_mib(c)}: {_tps(d)} tok/s = {d / best:.1f}x" if d and best else f"{_mib(c)}: -" for c, d in at5
    )
    top = figs.caps[0] if figs.caps else None
    lines = [
        *_header(figs, cmd, where, seconds),
        "",
        *_llama_table(figs),
        "",
        *_swarm_table(figs, rtts),
        "",
        f"- **Goal** (the swarm at 5 ms >= {GOAL:g}x llama.cpp's best capped decode, {best:,.1f} tok/s): "
        f"{'met' if met else 'not met'} ({ratios})." + _against_projection(figs, at5),
        "- **Where they cross** (the swarm at its largest cap): "
        + _cross(figs, "at 5 ms", swarm_tps(top, 5.0)[1] if top else None)
        + " "
        + _cross(figs, "over loopback", swarm_tps(top, 0.0)[1] if top else None),
        *_why(figs),
        *_notes(figs),
        "- **The swarm's answer checks:** with the coordinator's default audits, loopback, "
        + _audited(figs)
        + "."
        + (f" Nodes ran with `GLIBC_TUNABLES={figs.tunables}`." if figs.tunables else ""),
    ]
    return "\n".join(lines)
