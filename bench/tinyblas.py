"""Batched products with and without llamafile's tinyBLAS, and whether each row keeps its bits.

    .venv/bin/python bench/tinyblas.py [--plain DIR] [--reps 5] [--no-write]

For every weight type a model's dense matrices use (Q8_0, Q4_0, Q5_0, F16, BF16, F32): a random 8192 x 2048
matrix (the Qwen3.6-35B DeltaNet qkv shape) times 1, 8, 64 and 256 activation rows through
swarm.node.dense.linear, milliseconds per row (the best of --reps), and whether the batch gives every row
exactly its bits alone. This process uses the installed ggml (the README's build, with tinyBLAS); `--plain DIR`
runs the same measurement in a child process on a ggml-python installed in DIR without it (`pip install
--target DIR` with CMAKE_ARGS lacking -DGGML_LLAMAFILE=ON), side by side. Written to `bench:tinyblas`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import command, machine, publish  # noqa: E402

ROWS, COLS = 8192, 2048
BATCHES = (1, 8, 64, 256)
TYPES = ("Q8_0", "Q4_0", "Q5_0", "F16", "BF16", "F32")


def measure(reps: int) -> dict:
    """{type: {"ms_per_row": {n: ms}, "same_bits": bool}, "_tinyblas": bool} on this process's ggml."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from swarm.compute import dense, ggml, weights

    ggml.set_threads(2)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((max(BATCHES), COLS)).astype(np.float32))
    out: dict = {"_tinyblas": bool(ggml.ggml_lib().ggml_cpu_has_llamafile())}
    for name in TYPES:
        qtype = GGMLQuantizationType[name]
        w = rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
        data = np.ascontiguousarray(quants.quantize(w, qtype)).view(np.uint8).reshape(-1)
        weight = weights.Weight.of_bytes(data, int(qtype), (ROWS, COLS))
        alone = torch.cat([dense.linear([weight], x[i : i + 1].clone())[0] for i in range(max(BATCHES))])
        per_row, same = {}, True
        for n in BATCHES:
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                (y,) = dense.linear([weight], x[:n])
                best = min(best, time.perf_counter() - t)
            same = same and torch.equal(y, alone[:n])
            per_row[str(n)] = best * 1e3 / n  # str keys, as they come back through JSON
        out[name] = {"ms_per_row": per_row, "same_bits": same}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plain", type=Path, default=None, help="a ggml-python install without tinyBLAS")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.reps)))
        return 0
    runs = {"installed": measure(args.reps)}
    if args.plain is not None:
        env = {**os.environ, "PYTHONPATH": f"{args.plain}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        child = subprocess.run([sys.executable, __file__, "--child", "--reps", str(args.reps)], env=env,
                               capture_output=True, text=True, timeout=1800, check=True)  # fmt: skip
        runs["plain"] = json.loads(child.stdout.strip().splitlines()[-1])
    cmd = command("tinyblas.py", argv)
    lines = [
        "## Batched products: tinyBLAS and row bits (`bench/tinyblas.py`)",
        "",
        f"Command: `{cmd}`  ",
        f"Machine: {machine()}, 2 ggml threads. A random {ROWS} x {COLS} matrix of each type "
        f"times 1-{max(BATCHES)} rows, ms per row (best of {args.reps}); `same bits`: every row of every batch "
        "equals that row computed alone.",
        "",
        "| ggml | type | " + " | ".join(f"{n} rows" for n in BATCHES) + " | same bits |",
        "| --- | --- | " + " | ".join("---:" for _ in BATCHES) + " | --- |",
    ]
    for label, run in runs.items():
        what = f"{label} ({'tinyBLAS' if run['_tinyblas'] else 'no tinyBLAS'})"
        for name in TYPES:
            r = run[name]
            cells = " | ".join(f"{r['ms_per_row'][str(n)]:.3f}" for n in BATCHES)
            lines.append(f"| {what} | {name} | {cells} | {'yes' if r['same_bits'] else 'NO'} |")
    publish("tinyblas", "\n".join(lines), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
