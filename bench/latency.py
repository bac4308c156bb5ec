"""Decode tokens/s of the 35B layer shape through 4 nodes whose links add 0, 2, 5 and 25 ms of round trip:
without drafts, with prompt-lookup drafts, and with drafts known to be right (the checking window itself).

    .venv/bin/python bench/latency.py [--rtts 0,2,5,25] [--reps 4] [--decode-tokens 48] [--no-write]
    .venv/bin/python bench/latency.py --quick          # a smoke run (1 repetition, 0 and 5 ms, 16 tokens)

(about 12 min.) Model: `swarm synth` at the Qwen3.6-35B-A3B layer shape, 4 layers (bench/_models.py; made in
--workdir when absent). Four `swarm node` processes on this machine, each a disjoint quarter of the experts,
stay up for the whole run; for each round trip a relay process (bench/_relay.py: `tc netem` is not
available here) sits in front of every node's gRPC port and compute stream, and an engine is opened in this
process on the relay's addresses. Per round trip and repetition, each a greedy generation after one
64-token prompt (a 16-token passage repeated 4 times):

1. no drafts;
2. prompt-lookup drafts (coordinator/drafts/lookup.py PromptLookup(3)), with the accept rate;
3. known-right drafts: Scripted(prompt + the no-draft continuation, k) at k = 1, 2, 3; the text must equal
   the no-draft text;
4. what the published accept rate (~0.82 per draft, llama.cpp's draft-mtp on Qwen3.6-35B) would give at
   each k, from the measured known-right pass time: 1 + a + ... + a^k tokens per pass (independent
   acceptances);
5. beside each: the bound (tokens per pass) / (layers x RTT + pass compute at 0 ms), and a projection to
   40 layers.

Goals (reported met or not): no drafts at 2 and 5 ms >= 0.8x the bound; 3 known-right drafts at 5 ms >= 2.5x
the no-draft figure. Figures go to the `bench:latency` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys
import time
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from swarm.compute.openmp import set_wait_policy  # noqa: E402

set_wait_policy(experts_remote=True)  # as `swarm run` does, before torch loads (nodes share these cores)

from _doc import command, machine, publish  # noqa: E402
from _latency_report import CONFIGS, KNOWN, LOOKUP, NONE, PASSAGE, REPEATS, Figures, render  # noqa: E402
from _latency_rows import batched, matmul_ms  # noqa: E402
from _latency_swarm import Drafter, Nodes, linked, timed  # noqa: E402
from _models import prepare, prompt_tokens  # noqa: E402
from _relay import measured_rtt_ms  # noqa: E402

from swarm.coordinator.drafts.lookup import PromptLookup, Scripted  # noqa: E402
from swarm.coordinator.engine import Engine  # noqa: E402
from swarm.sharding.slabs import read_manifest  # noqa: E402

log = logging.getLogger("bench.latency")
T = TypeVar("T")


def rotated(items: list[T], rep: int) -> list[T]:
    """items started at rep's place in them: who goes first turns with the repetitions."""
    n = rep % len(items) if items else 0
    return items[n:] + items[:n]


class Bench:
    """The nodes, the reference continuation, and every run's figures."""

    def __init__(self, args: argparse.Namespace, shard: Path, figs: Figures) -> None:
        self.args, self.shard, self.figs = args, shard, figs
        self.prompt: list[int] = []
        self.reference: list[int] = []
        self.nodes = Nodes(shard, args.nodes, args.workdir / "latency-nodes")

    def _drafter(self, config: str) -> Drafter | None:
        if config == NONE:
            return None
        if config == LOOKUP:
            return PromptLookup(3)
        return Scripted(tuple(self.prompt + self.reference), KNOWN.index(config) + 1)

    def warm_up(self) -> None:
        """The first generation on the nodes (their first calls to each expert), directly: untimed, its
        continuation the reference every later run must give."""
        with linked(self.nodes, None, self.args.threads, self.args.audit, {}) as engine:
            passage = prompt_tokens(engine, PASSAGE)
            self.prompt = passage * REPEATS
            run = timed(engine, self.nodes, self.prompt, self.args.decode_tokens, None)
            self.reference = run.tokens
            self.figs.text = engine.tokenizer.decode(run.tokens)
        log.info("warm-up: %.2f tok/s; continuation %r", run.tps, self.figs.text[:80])

    def _one(self, engine: Engine, config: str, rtt: float | None) -> None:
        run = timed(engine, self.nodes, self.prompt, self.args.decode_tokens, self._drafter(config))
        where = "direct" if rtt is None else f"{rtt:g} ms"
        if run.tokens != self.reference:
            text = engine.tokenizer.decode(run.tokens)
            self.figs.mismatches.append(f"{where} {config}: {text[:60]!r}")
        self.figs.runs.setdefault((config, rtt), []).append(run)
        log.info(
            "%-7s %-7s %6.2f tok/s  %2d passes  accepted %d/%d  blocked %.1f ms/pass",
            where, config, run.tps, run.passes, run.accepted, run.drafted, run.wait_s / run.passes * 1e3,
        )  # fmt: skip

    def at(self, rtt: float | None, rep: int) -> None:
        """One engine on the nodes (through a relay adding rtt ms, or directly), every configuration once."""
        self.figs.loads.append(os.getloadavg()[0])
        configs = [NONE] if rtt is None else rotated(list(CONFIGS), rep)
        said: dict[str, object] = {}
        with linked(self.nodes, rtt, self.args.threads, self.args.audit, said) as engine:
            for config in configs:
                self._one(engine, config, rtt)
        if rtt is None:
            return
        carried: dict[str, int] = said.get("carried", {})  # type: ignore[assignment]
        streams: list[str] = said.get("streams", [])  # type: ignore[assignment]
        missing = [a for a in streams if not carried.get(a)]
        if missing:
            # a node's compute calls went around the relay: the figures would not have its latency
            raise RuntimeError(f"no compute-stream bytes crossed the relay at {', '.join(missing)}")
        late: list[float] = said.get("late_ms", [0.0])  # type: ignore[assignment]
        self.figs.late_ms.setdefault(rtt, []).append(late[0])

    def run(self) -> None:
        if not self.nodes.alive():
            raise RuntimeError("a node exited")
        self.warm_up()
        settings: list[float | None] = [None, *self.args.rtts]
        for rep in range(self.args.reps):
            for rtt in rotated(settings, rep):
                self.at(rtt, rep)

    def close(self) -> None:
        self.nodes.close()


def measure(args: argparse.Namespace) -> Figures:
    args.workdir.mkdir(parents=True, exist_ok=True)
    _, shard = prepare("qwen35moe", args.layers, args.workdir)
    layers = len(read_manifest(shard).moe_layers)
    ping = {r: measured_rtt_ms(r) for r in args.rtts}
    log.info("relay pings: %s", ping)
    figs = Figures(
        layers=layers,
        n_prompt=PASSAGE * REPEATS,
        n_decode=args.decode_tokens,
        reps=args.reps,
        threads=args.threads,
        audit=args.audit,
        rtts=list(args.rtts),
        ping_ms=ping,
    )
    bench = Bench(args, shard, figs)
    try:
        bench.run()
    finally:
        bench.close()
    # with the nodes gone: what one more row costs the coordinator's dense products
    figs.matmul_ms, figs.matmul_batched = matmul_ms(threads=args.threads), batched()
    log.info("a Q8_0 product by rows: %s ms", {n: round(v, 2) for n, v in figs.matmul_ms.items()})
    return figs


def _ms_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give milliseconds, comma-separated, e.g. 0,2,5"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: round trips cannot be negative")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rtts", type=_ms_list, default=_ms_list("0,2,5,25"), help="added round trips, ms")
    p.add_argument("--reps", type=int, default=4, help="repetitions (medians)")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--layers", type=int, default=4, help="layers of the synthesized model")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="compute threads of the coordinator (this process)")
    p.add_argument(
        "--audit",
        type=float,
        default=0.0,
        help="share of node answers the coordinator checks (0: trusted, so that the figures are the "
        "network's and the compute's, not the audits')",
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 repetition, 0 and 5 ms, 16 tokens")
    p.add_argument("--workdir", type=Path, default=Path("/work/bench-models/decode"))
    p.add_argument("--no-write", action="store_true", help="print instead of writing docs/BENCHMARKS.md")
    p.add_argument(
        "--render-last",
        action="store_true",
        help="no run: the section again from the figures the last full run kept in --workdir",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.rtts, args.decode_tokens = 1, [0.0, 5.0], 16
    if 0.0 not in args.rtts:
        p.error("--rtts must include 0: the bounds take each configuration's compute from it")
    if args.reps < 1 or args.decode_tokens < 2:
        p.error("give --reps >= 1 and --decode-tokens >= 2")
    if not 0.0 <= args.audit <= 1.0:
        p.error(f"--audit {args.audit}: give a share between 0 and 1")
    args.rtts = sorted(args.rtts)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("bench").setLevel(logging.INFO)
    kept = args.workdir / "latency-figures.pickle"  # the last full run's, to render the section again
    if args.render_last:
        if not kept.exists():
            raise SystemExit(f"no figures kept in {kept}: run the bench first")
        figs, cmd, where = pickle.loads(kept.read_bytes())
    else:
        t0 = time.monotonic()
        try:
            figs = measure(args)
        except RuntimeError as e:
            raise SystemExit(f"latency bench failed: {e}") from None
        figs.seconds = time.monotonic() - t0
        cmd, where = command("latency.py", argv), machine()
        if not args.quick:
            kept.write_bytes(pickle.dumps((figs, cmd, where)))
    text = render(figs, cmd, where)
    publish("latency", text, write=not (args.no_write or args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
