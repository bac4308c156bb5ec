"""The same benches on two checkouts side by side: does a change that should move code, not speed, keep the figures?

    .venv/bin/python bench/two_trees.py --base /tmp/base [--reps 2] [--no-write]

`--base` is another checkout (e.g. `git worktree add /tmp/base <commit>`) with its own `.venv` (a copy of this
one, then `/tmp/base/.venv/bin/python -m pip install --no-deps -e /tmp/base`). Each repetition runs, for both
trees in alternating order: `swarm demo` (wall time as a user meets it), bench/decode.py's in-process and
4-loopback-node rows (one cold run each) and bench/serve.py's two swarm servers (1 and 8 requests at once),
every one with `--no-write`; the figures are read back from what each bench prints. Then this tree's
bench/_work_per_token.py in each tree: the coordinator's Python calls per token (torch's among them), counts
that a busy machine does not blur. Medians per tree, and the median of the per-repetition ratios (this tree /
base). Figures go to the `bench:two-trees` section.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _doc import command, machine, publish

HERE = Path(__file__).resolve().parent.parent
WORK_SCRIPT = Path(__file__).resolve().parent / "_work_per_token.py"

# (figure, bench, the table row it is read from, column index after the label)
FIGURES = (
    ("decode: in-process prefill tok/s", "decode", "in-process experts", 0),
    ("decode: in-process decode tok/s", "decode", "in-process experts", 1),
    ("decode: 4 nodes prefill tok/s", "decode", "swarm, 4 loopback nodes", 0),
    ("decode: 4 nodes decode tok/s", "decode", "swarm, 4 loopback nodes", 1),
    ("serve --local: 1 at once tok/s", "serve", "swarm serve --local", 0),
    ("serve --local: 8 at once tok/s", "serve", "swarm serve --local", 3),
    ("serve, 4 nodes: 1 at once tok/s", "serve", "swarm serve, 4 loopback nodes", 0),
    ("serve, 4 nodes: 8 at once tok/s", "serve", "swarm serve, 4 loopback nodes", 3),
)


def run(tree: Path, args: list[str], timeout: float) -> str:
    """One bench in a tree, in a session of its own: stopped with everything it started (its servers and
    nodes) when it times out or this script is interrupted or terminated."""
    proc = subprocess.Popen([str(tree / ".venv/bin/python"), *args], cwd=tree, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed ({proc.returncode}):\n{err[-3000:]}")
    return out


def row_value(text: str, label: str, column: int) -> float:
    """The first number of a table cell: `| label | 94.7 | 34.5 | ...` or `| label | 23.5, 0.65 | ...`."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == label:
            return float(re.match(r"[0-9.]+", cells[1 + column]).group(0))  # type: ignore[union-attr]
    raise SystemExit(f"no row {label!r} in the bench's output:\n{text[-2000:]}")


def one_tree(tree: Path, workdir: Path) -> dict[str, float]:
    figures: dict[str, float] = {}
    t0 = time.perf_counter()
    run(tree, ["-m", "swarm.coordinator.cli", "demo"], 900)
    figures["swarm demo: wall s"] = time.perf_counter() - t0
    texts = {
        "decode": run(tree, ["bench/decode.py", "--model", "qwen35moe", "--reps", "1", "--only", "in-process,swarm",
                             "--workdir", str(workdir), "--no-write"], 1800),
        "serve": run(tree, ["bench/serve.py", "--reps", "1", "--workdir", str(workdir), "--no-write"], 1800),
    }  # fmt: skip
    for name, bench, label, column in FIGURES:
        figures[name] = row_value(texts[bench], label, column)
    for where in ("in process", "4 nodes"):  # the same script in both trees: bench/_work_per_token.py's counts
        figures |= json.loads(run(tree, [str(WORK_SCRIPT), str(workdir), where], 900).strip().splitlines()[-1])
    return figures


def render(args: argparse.Namespace, runs: dict[str, list[dict[str, float]]], base_rev: str, head_rev: str) -> str:
    names = list(runs["head"][0])
    lines = [
        "## The same benches on two commits (`bench/two_trees.py`)",
        "",
        f"Command: `{command('two_trees.py', None)}`  ",
        f"Machine: {machine()}.  ",
        f"Trees: this one at {head_rev}, base at {base_rev}. {args.reps} repetitions, the trees in alternating "
        "order; each bench run cold with one repetition per tree (bench/decode's in-process and swarm rows, "
        "bench/serve's two swarm servers, `swarm demo`'s wall time; the calls per token counted by this tree's "
        "bench/_work_per_token.py under cProfile in each tree). Medians; the ratio is the median of the "
        "per-repetition ratios.",
        "",
        "| figure | base | this tree | this / base | each repetition's ratio |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for n in names:
        b = [r[n] for r in runs["base"]]
        h = [r[n] for r in runs["head"]]
        ratios = [x / y for x, y in zip(h, b, strict=True)]
        lines.append(
            f"| {n} | {statistics.median(b):.2f} | {statistics.median(h):.2f} | "
            f"{statistics.median(ratios):.2f}x | {', '.join(f'{r:.2f}' for r in ratios)} |"
        )
    return "\n".join(lines)


def rev(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the other checkout, with its own .venv")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=Path("/work/bench-models/decode"))
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/BENCHMARKS.md")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # terminated: stop the running bench's session too
    trees = {"base": args.base.resolve(), "head": HERE}
    runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    for i in range(args.reps):
        for name in ("base", "head") if i % 2 == 0 else ("head", "base"):
            print(f"repetition {i + 1}: {name} ({trees[name]})", file=sys.stderr, flush=True)
            runs[name].append(one_tree(trees[name], args.workdir))
    publish("two-trees", render(args, runs, rev(trees["base"]), rev(HERE)), not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
