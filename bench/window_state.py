"""What taking a checking window back costs, two ways: the per-row states the window keeps (DecoderModel's
marks: every DeltaNet layer keeps its conv and recurrent state after each row, so a rejected draft costs a
restore) against recomputing (a copy of every state before the window, and a pass over the kept rows again
when a draft is rejected).

    .venv/bin/python bench/window_state.py [--drafts 1,2,3] [--reps 30] [--workdir /work/bench-models/decode]
                                           [--no-write]

The Qwen3.6-35B-A3B layer shape (4 layers: 3 Gated DeltaNet, 1 attention; Q4_K experts, Q8_0 dense;
bench/_models.py), experts in process, one sequence after a 64-token prompt. Per k drafts, medians of --reps:
a window pass of 1 + k rows without marks, the same with a mark after every row but the last, the state copy
recomputing needs before each window, and a pass over the kept rows (half the window, rounded up: the
recompute after a rejection). Figures scale with the number of DeltaNet layers (30 of 40 in the real model).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from _doc import bench_args, bench_parser, command, machine, publish
from _models import prepare, prompt_tokens

from swarm.coordinator.config import EngineConfig
from swarm.coordinator.engine import open_engine


def timed(fn: object, reps: int) -> float:
    """Median seconds of fn() over reps calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(args: argparse.Namespace) -> str:
    gguf, _ = prepare("qwen35moe", 4, Path(args.workdir))
    engine = open_engine(gguf, EngineConfig(local=True, device="cpu"))
    model = engine.model
    prompt = prompt_tokens(engine, 64)
    base = model.new_state()
    with torch.inference_mode():
        model(torch.tensor(prompt), [base], [len(prompt)], last_only=True)
    cp = base.checkpoint()
    rows = []
    for k in args.drafts:
        ids = torch.tensor(prompt[: k + 1])
        state = model.new_state()

        def window(marks: bool, k: int = k, ids: torch.Tensor = ids, state: object = state) -> None:
            state.restore(cp)  # type: ignore[attr-defined]
            with torch.inference_mode():
                model(ids, [state], [k + 1], marks=[tuple(range(1, k + 1))] if marks else (), tails=[k + 1])
            state.marked.clear()  # type: ignore[attr-defined]

        def copy(state: object = state) -> None:
            state.checkpoint()  # type: ignore[attr-defined]

        kept = (k + 2) // 2

        def again(kept: int = kept, ids: torch.Tensor = ids, state: object = state) -> None:
            state.restore(cp)  # type: ignore[attr-defined]
            with torch.inference_mode():
                model(ids[:kept], [state], [kept], last_only=True)

        for f in (lambda: window(False), lambda: window(True), copy, again):  # warm: graphs built
            f()
        restore = timed(
            lambda state=state: state.restore(cp), args.reps
        )  # part of every figure above: subtracted
        plain = timed(lambda: window(False), args.reps) - restore
        marked = timed(lambda: window(True), args.reps) - restore
        rows.append((k, plain, marked, timed(copy, args.reps), timed(again, args.reps) - restore))
        print(rows[-1], file=sys.stderr, flush=True)
    engine.close()
    lines = [
        f"`{command('window_state.py', args.argv)}` on {machine()}; load average before the run {args.load:.1f}. "
        "4 layers of the Qwen3.6-35B-A3B shape in process (3 DeltaNet layers), one sequence, medians of "
        f"{args.reps}, milliseconds.",
        "",
        "| drafts | window pass | with a state per row | per-row states cost | state copy before a window "
        "| pass over the kept rows again |",
        "|---|---|---|---|---|---|",
    ]
    for k, plain, marked, copy_s, again_s in rows:
        lines.append(
            f"| {k} | {plain * 1e3:.2f} | {marked * 1e3:.2f} | {(marked - plain) * 1e3:+.2f} | "
            f"{copy_s * 1e3:.2f} | {again_s * 1e3:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--drafts", default="1,2,3")
    p.add_argument("--reps", type=int, default=30)
    args = bench_args(p, argv)
    args.drafts = [int(x) for x in args.drafts.split(",")]
    publish("window-state", bench(args), not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
