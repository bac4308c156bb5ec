"""bench/latency.py's figures and its docs/BENCHMARKS.md section: the bounds, the accept-rate arithmetic, the
40-layer projection, the goals, and where a step's time goes."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from _latency_swarm import Run

NONE, LOOKUP = "none", "lookup"
KNOWN = ("known1", "known2", "known3")  # known-right drafts, k = 1, 2, 3
CONFIGS = (NONE, LOOKUP, *KNOWN)
PUBLISHED_ACCEPT = 0.82  # llama.cpp's draft-mtp on Qwen3.6-35B at 2 drafts (Strata: 1.60x decode at --mtp 2)
PROJECT_LAYERS = 40  # Qwen3.6-35B-A3B's layer count
GOAL_BOUND = 0.8  # no drafts at 2 and 5 ms: decode >= this share of the bound
GOAL_WINDOW = 2.5  # 3 known-right drafts at 5 ms: >= this many times the no-draft figure
PASSAGE, REPEATS = 16, 4  # the prompt: a passage of bench/_models.py's text, repeated
LABELS = {
    NONE: "none",
    LOOKUP: "prompt lookup, PromptLookup(3)",
    **{k: f"known-right drafts, k = {k[-1]}" for k in KNOWN},
}


def expected_tokens(accept: float, k: int) -> float:
    """Tokens one pass with k drafts yields when each draft is kept with probability `accept` once the ones
    before it were (independent acceptances): 1 + a + a^2 + ... + a^k (the token after the last kept row
    always comes)."""
    return sum(accept**i for i in range(k + 1))


def bound_tps(tokens_per_pass: float, layers: int, rtt_s: float, compute_s: float) -> float:
    """The most tokens/s a pass of `compute_s` (its compute, measured without added latency) can give when
    each of its `layers` expert layers waits one round trip: tokens per pass / (layers x RTT + compute)."""
    return tokens_per_pass / (layers * rtt_s + compute_s)


def projected_pass_s(pass_s: float, rtt_s: float, layers: int, to_layers: int = PROJECT_LAYERS) -> float:
    """A pass of a `to_layers`-layer model (a projection, not a measurement): to_layers x (RTT + per-layer
    compute), the per-layer compute being what this pass spent per layer past its round trips."""
    per_layer = (pass_s - layers * rtt_s) / layers
    return to_layers * (rtt_s + per_layer)


@dataclass
class Figures:
    """One bench run. Keys of `runs`: (configuration, added RTT in ms; None: the nodes reached directly)."""

    layers: int  # expert layers a pass crosses: a round trip each
    n_prompt: int
    n_decode: int
    reps: int
    threads: int
    audit: float
    rtts: list[float]
    ping_ms: dict[float, float]  # relay setting -> measured median ping through it
    runs: dict[tuple[str, float | None], list[Run]] = field(default_factory=dict)
    # relay setting -> each engine's mean lateness of a chunk past its due time (bench/_relay.py), ms
    late_ms: dict[float, list[float]] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)  # 1-minute load average at each engine's start
    mismatches: list[str] = field(default_factory=list)  # runs whose text differed from the reference
    text: str = ""  # the reference continuation
    matmul_ms: dict[int, float] = field(
        default_factory=dict
    )  # rows -> one dense Q8_0 product (_latency_rows)
    matmul_batched: bool = True  # ... its rows in one ggml product (else one at a time)
    seconds: float = 0.0

    def med(self, config: str, rtt: float | None, what: str = "tps") -> float:
        runs = self.runs.get((config, rtt), [])
        if not runs:
            return float("nan")
        values = {
            "tps": [r.tps for r in runs],
            "pass_s": [r.decode_s / r.passes for r in runs],
            "per_pass": [(len(r.tokens) - 1) / r.passes for r in runs],
            "wait_s": [r.wait_s / r.passes for r in runs],
            "busy_sum": [sum(r.node_busy_s) / r.passes for r in runs],
            "busy_max": [max(r.node_busy_s) / r.passes for r in runs],
        }[what]
        return statistics.median(values)

    def bound(self, config: str, rtt: float, per_pass: float | None = None) -> float:
        """The bound beside a configuration: its tokens per pass over (layers x RTT + its pass time at 0 ms)."""
        tpp = self.med(config, rtt, "per_pass") if per_pass is None else per_pass
        return bound_tps(tpp, self.layers, rtt / 1e3, self.med(config, 0.0, "pass_s"))

    def projected(self, config: str, rtt: float, per_pass: float | None = None) -> tuple[float, float]:
        """(measured, bound) tokens/s projected to PROJECT_LAYERS layers."""
        tpp = self.med(config, rtt, "per_pass") if per_pass is None else per_pass
        r = rtt / 1e3
        measured = tpp / projected_pass_s(self.med(config, rtt, "pass_s"), r, self.layers)
        bound = tpp / projected_pass_s(self.layers * r + self.med(config, 0.0, "pass_s"), r, self.layers)
        return measured, bound

    def ratio_by_rep(self, a: tuple[str, float], b: tuple[str, float]) -> list[float]:
        """tok/s of a over b, repetition by repetition (the two ran on one engine, minutes apart at most)."""
        return [x.tps / y.tps for x, y in zip(self.runs.get(a, []), self.runs.get(b, []), strict=False)]


def goals(f: Figures) -> list[str]:
    out = []
    for rtt in (2.0, 5.0):
        if (NONE, rtt) not in f.runs or (NONE, 0.0) not in f.runs:
            continue
        share = f.med(NONE, rtt) / f.bound(NONE, rtt)
        met = "met" if share >= GOAL_BOUND else "NOT met"
        out.append(f"- No drafts at {rtt:g} ms: {share:.2f}x the bound (goal >= {GOAL_BOUND}x): **{met}**.")
    if (KNOWN[-1], 5.0) in f.runs and (NONE, 5.0) in f.runs:
        ratios = f.ratio_by_rep((KNOWN[-1], 5.0), (NONE, 5.0))
        r = statistics.median(ratios)
        met = "met" if r >= GOAL_WINDOW else "NOT met"
        each = ", ".join(f"{x:.2f}" for x in ratios)
        out.append(
            f"- 3 known-right drafts at 5 ms: {r:.2f}x the no-draft figure (median of each repetition's "
            f"ratio: {each}; goal >= {GOAL_WINDOW}x): **{met}**."
        )
    return out


def _runs(runs: Sequence[Run]) -> str:
    return ", ".join(f"{r.tps:.1f}" for r in runs)


def _row(f: Figures, rtt: float, config: str) -> str:
    tps, tpp, pass_ms = f.med(config, rtt), f.med(config, rtt, "per_pass"), f.med(config, rtt, "pass_s") * 1e3
    bound = f.bound(config, rtt)
    proj, proj_bound = f.projected(config, rtt)
    extra = ""
    if config == LOOKUP:
        runs = f.runs[(config, rtt)]
        drafted, accepted = sum(r.drafted for r in runs), sum(r.accepted for r in runs)
        windows = sum(r.windows for r in runs)
        rate = f"{accepted / drafted:.2f}" if drafted else "-"
        extra = f" (drafted {drafted}, accepted {accepted}, windows {windows}: accept rate {rate})"
    return (
        f"| {rtt:g} | {LABELS[config]}{extra} | **{tps:.2f}** ({_runs(f.runs[(config, rtt)])}) | {tpp:.2f} | "
        f"{pass_ms:.1f} | {bound:.2f} | {tps / bound:.2f}x | {proj:.2f} ({proj_bound:.2f}) |"
    )


def _published_rows(f: Figures, rtt: float) -> list[str]:
    rows = []
    for k, config in enumerate(KNOWN, start=1):
        if (config, rtt) not in f.runs:
            continue
        e = expected_tokens(PUBLISHED_ACCEPT, k)
        tps = e / f.med(config, rtt, "pass_s")
        bound = f.bound(config, rtt, per_pass=e)
        proj, proj_bound = f.projected(config, rtt, per_pass=e)
        rows.append(
            f"| {rtt:g} | accept {PUBLISHED_ACCEPT} (published), k = {k}: from the known-right pass time | "
            f"{tps:.2f} (expected) | {e:.2f} | {f.med(config, rtt, 'pass_s') * 1e3:.1f} | {bound:.2f} | "
            f"{tps / bound:.2f}x | {proj:.2f} ({proj_bound:.2f}) |"
        )
    return rows


def table(f: Figures) -> list[str]:
    out = [
        f"| RTT added, ms | drafts | decode tok/s, median (each run) | tokens / pass | ms / pass | bound, "
        f"tok/s | vs bound | {PROJECT_LAYERS} layers, projected: tok/s (bound) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    if (NONE, None) in f.runs:
        runs = f.runs[(NONE, None)]
        out.append(
            f"| direct | none, no relay | **{f.med(NONE, None):.2f}** ({_runs(runs)}) | 1.00 | "
            f"{f.med(NONE, None, 'pass_s') * 1e3:.1f} | | | |"
        )
    for rtt in f.rtts:
        out += [_row(f, rtt, c) for c in CONFIGS if (c, rtt) in f.runs]
        out += _published_rows(f, rtt)
    return out


def breakdown(f: Figures) -> list[str]:
    """Per pass, where the time goes: blocked on the nodes, the coordinator's own work, the nodes' compute."""
    out = [
        "| RTT added, ms | drafts | ms / pass | blocked on nodes | coordinator (pass - blocked) | "
        "blocked past layers x RTT and the 0 ms wait | nodes busy: sum (busiest) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for config in (NONE, KNOWN[-1]):
        base = f.med(config, 0.0, "wait_s") if (config, 0.0) in f.runs else float("nan")
        for rtt in f.rtts:
            if (config, rtt) not in f.runs:
                continue
            p, w = f.med(config, rtt, "pass_s"), f.med(config, rtt, "wait_s")
            past = w - base - f.layers * rtt / 1e3
            out.append(
                f"| {rtt:g} | {LABELS[config]} | {p * 1e3:.1f} | {w * 1e3:.1f} | {(p - w) * 1e3:.1f} | "
                f"{past * 1e3:+.1f} | {f.med(config, rtt, 'busy_sum') * 1e3:.1f} "
                f"({f.med(config, rtt, 'busy_max') * 1e3:.1f}) |"
            )
    return out


def render(f: Figures, cmd: str, machine: str) -> str:
    """The bench:latency section."""
    load = f"{min(f.loads):.2f}-{max(f.loads):.2f}" if f.loads else "?"
    same = (
        "every run's text (and tokens) equalled the no-draft reference"
        if not f.mismatches
        else f"DIFFERENT text in {len(f.mismatches)} runs: {'; '.join(f.mismatches[:5])}"
    )
    pings = ", ".join(f"{r:g} ms: {p:.2f} ms" for r, p in sorted(f.ping_ms.items()))
    lines = [
        "## Decode under network latency, with and without drafts (`bench/latency.py`)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine}; 1-minute load average {load} across the run (the machine's 2 cores are shared "
        f"with other engineers' test runs); the run took {f.seconds / 60:.1f} min.  ",
        f"Model: `swarm synth` qwen3.6-35b-a3b preset (the 35B layer shape: D 2048, E 256, K 8, F 512, shared "
        f"F 512), {f.layers} layers, Q4_K experts, Q8_0 dense (bench/_models.py), random weights.  ",
        f"Swarm: 4 `swarm node` processes on this machine (node defaults: `--no-mdns --experts RANGE`, one "
        f"compute thread each as spawn_node starts them), each a disjoint quarter of every layer's experts; the "
        f"coordinator is this process (`open_engine(peers=...)`, {f.threads} thread, `audit={f.audit:g}`), "
        f"`generate()` greedy.  ",
        "Latency: `tc netem` is not available here, so every connection (gRPC and compute stream) goes through "
        "the delaying TCP relay bench/_relay.py, which writes each chunk half a round trip after it read it, "
        f"each way (measured 1-byte ping through it: {pings}); 0 ms is the relay with no delay, `direct` the "
        "nodes without it.  ",
        f"Workload: a {f.n_prompt}-token prompt (a {PASSAGE}-token passage repeated {REPEATS} times), then "
        f"{f.n_decode} greedy tokens; decode tok/s is GenerationStats.decode_tps (the {f.n_decode - 1} tokens after the "
        f"one prefill gives). {f.reps} repetitions, each opening one engine per RTT (RTTs rotated, drafts "
        f"configurations rotated); medians. Text: {same}.",
        "",
        *table(f),
        "",
        f"- Bound: tokens per pass / ({f.layers} layers x RTT + that configuration's pass time measured at 0 ms);"
        " for no drafts 1 / (layers x RTT + compute per token). A pass can beat it a little: the coordinator's "
        "shared expert overlaps the nodes' calls.",
        f"- {PROJECT_LAYERS} layers, projected (not measured): pass time {PROJECT_LAYERS} x (RTT + per-layer "
        "compute), the per-layer compute being the measured pass time less its round trips, over the layers "
        f"(so the output head and the nodes' work, which share this machine's cores, count as per-layer); in "
        f"brackets the same for the bound. Qwen3.6-35B-A3B has {PROJECT_LAYERS} layers.",
        "- Known-right drafts: Scripted(prompt + continuation, k) fed the no-draft continuation; every draft "
        "is kept, so a pass yields k + 1 tokens (the last pass fewer when the run ends).",
        f"- Published accept rate: llama.cpp's draft-mtp on Qwen3.6-35B keeps ~{PUBLISHED_ACCEPT} of the drafts at 2 "
        "drafts (Strata: 1.60x decode at `--mtp 2`). A pass with k drafts yields 1 + a + ... + a^k tokens on "
        "average if each draft is kept with probability a independently of the others (an assumption); the "
        "rows take the measured known-right pass time at that k (a rejected draft costs its row anyway).",
        "",
        "Goals:",
        "",
        *goals(f),
        "",
        "Where a pass's time goes (ms per pass, medians; blocked = SwarmExperts.wait_seconds, the model waiting "
        "for node replies and unpacking them; nodes busy = the nodes' own Stats busy_seconds):",
        "",
        *breakdown(f),
        "",
        *findings(f),
    ]
    return "\n".join(lines)


def _relay_notes(f: Figures) -> list[str]:
    out = []
    if (NONE, None) in f.runs and (NONE, 0.0) in f.runs:
        ratios = f.ratio_by_rep((NONE, 0.0), (NONE, None))
        out.append(
            f"- The relay itself: no drafts through it at 0 ms ran {statistics.median(ratios):.2f}x the "
            f"direct figure (each repetition: {', '.join(f'{r:.2f}' for r in ratios)}); its 1-byte ping adds "
            f"{f.ping_ms.get(0.0, float('nan')):.2f} ms. Chunks left it on average "
            + ", ".join(f"{statistics.median(v):.2f} ms" for _, v in sorted(f.late_ms.items()))
            + " past their due time at "
            + ", ".join(f"{r:g}" for r in sorted(f.late_ms))
            + " ms (over each engine's whole life: the prompts' bulk transfers, which queue behind each other, "
            "included)."
        )
        blocked = f.med(NONE, None, "wait_s"), f.med(NONE, 0.0, "wait_s")
        out.append(
            f"- Direct, the model waited {blocked[0] * 1e3:.1f} ms a pass on the nodes, through the 0 ms relay "
            f"{blocked[1] * 1e3:.1f} ms: the relay's extra hop does not slow a pass here (why direct waits "
            "longer is not established: each of the coordinator's sends then wakes a node thread at once, "
            "which may take the core the coordinator runs on; the machine is shared and loaded)."
        )
    runs = [r for rs in f.runs.values() for r in rs]
    out.append(
        f"- Hedging and failover (coordinator/experts/remote/pending.py) never fired: {sum(r.hedges for r in runs)} "
        f"hedged calls and {sum(r.failovers for r in runs)} failovers in all runs (a call is hedged only after "
        "max(0.5 s, 4x the node's usual time), and with disjoint quarters no other holder exists)."
    )
    return out


def _window_notes(f: Figures) -> list[str]:
    out = []
    if (NONE, 0.0) not in f.runs:
        return out
    one = f.med(NONE, 0.0, "pass_s")
    coord1 = one - f.med(NONE, 0.0, "wait_s")
    busy1 = f.med(NONE, 0.0, "busy_sum")
    parts = []
    for k, config in enumerate(KNOWN, start=1):
        if (config, 0.0) in f.runs:
            p = f.med(config, 0.0, "pass_s")
            coord = p - f.med(config, 0.0, "wait_s")
            parts.append(
                f"k = {k}: {p / one:.2f}x (coordinator {coord / coord1:.2f}x, nodes' busy time "
                f"{f.med(config, 0.0, 'busy_sum') / busy1:.2f}x)"
            )
    if parts:
        out.append(
            "- What a checking window costs at 0 ms, against a one-token pass: " + "; ".join(parts) + ". "
            "Published: llama.cpp's 1.60x at `--mtp 2` with ~0.82 accepted per draft "
            f"({expected_tokens(PUBLISHED_ACCEPT, 2):.2f} tokens a pass) means its 2-draft pass costs "
            f"{expected_tokens(PUBLISHED_ACCEPT, 2) / 1.60:.2f}x a one-token pass."
        )
    if f.matmul_ms:
        how = "in one batched ggml product" if f.matmul_batched else "one row at a time (compute/graph.py)"
        each = " / ".join(f"{v:.2f}" for v in f.matmul_ms.values())
        counts = list(f.matmul_ms)
        first, last = f.matmul_ms[counts[0]], f.matmul_ms[counts[-1]]
        added = (last - first) / max(1, counts[-1] - counts[0]) / first
        busy = ""
        if (KNOWN[-1], 0.0) in f.runs:
            busy = f" ({f.med(KNOWN[-1], 0.0, 'busy_sum') / f.med(NONE, 0.0, 'busy_sum'):.2f}x at 4 rows)"
        out.append(
            f"- The coordinator's dense products amortize only partly over a window's rows on this CPU: a Q8_0 "
            f"[4096 x 2048] matrix times {' / '.join(map(str, counts))} rows ({how}, {f.threads} thread) takes "
            f"{each} ms (the fastest of 31): each row past the first adds {added:.0%} of a one-row product "
            "(ggml's int8 dot products on one AVX2 thread are bound by their arithmetic, not by reading the "
            f"weights once). The nodes' busy time grows with the rows too{busy}: each row brings its own 8 "
            "experts, whose weights are read for it."
        )
    if (KNOWN[-1], 0.0) in f.runs and 5.0 in f.rtts:
        r = f.layers * 5e-3
        best = f.bound(KNOWN[-1], 5.0, per_pass=4.0) / f.bound(NONE, 5.0, per_pass=1.0)
        need = 4.0 * (r + one) / GOAL_WINDOW - r
        out.append(
            f"- At 5 ms the bounds alone allow 3 known-right drafts {best:.2f}x the no-draft figure (4 tokens "
            f"over {f.layers} x 5 ms + the 3-draft pass's compute, against 1 over {f.layers} x 5 ms + one "
            f"token's): {GOAL_WINDOW}x needs a 3-draft pass of at most {need * 1e3:.0f} ms of compute "
            f"({need / one:.2f}x a one-token pass), where it measured {f.med(KNOWN[-1], 0.0, 'pass_s') * 1e3:.0f} ms."
        )
    return out


def findings(f: Figures) -> list[str]:
    """What the figures say about where the time goes (each sentence computed from this run)."""
    out = ["Findings:", ""]
    out += _relay_notes(f)
    out += _window_notes(f)
    lookup = [r for (c, _), rs in f.runs.items() if c == LOOKUP for r in rs]
    if lookup and not any(r.drafted for r in lookup):
        out.append(
            "- Prompt lookup drafted nothing: the model's random weights never continue the repeated passage, "
            "so no suffix of the generated text occurs earlier and PromptLookup finds no match (its row "
            "measures the lookup's own cost); the published-rate rows stand in for a real model's drafts."
        )
    return out
