"""What a row's bits not depending on its batch costs the dense products: each weight type multiplied as swarm
does it (Graph.mul_mat: one batch where the rows keep their bits, else a batch of one-row products) against
one plain ggml batch (where ggml picks its batched kernels: the repacked GEMM, tinyBLAS), and whether that
batch gives every row the bits it gets alone.

    .venv/bin/python bench/batch_kernels.py [--types Q4_K,Q6_K,Q8_0,Q5_K,Q4_0,IQ4_NL,F16,BF16] \
        [--shape 8192x2048] [--rows 1,16,64] [--threads 2] [--no-write]

A matrix of each type (seeded normal values as ggml quantizes them; in ggml's repacked layout where this CPU
has one, as the coordinator keeps its dense matrices) times seeded rows; each timing the median of repeated
runs of a kept graph. Figures go to docs/BENCHMARKS.md, section `batch-kernels`.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import bench_args, bench_parser, command, machine, publish  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from swarm.compute import probes, weights  # noqa: E402
from swarm.compute.ggml import set_threads  # noqa: E402
from swarm.compute.graph import Graph, repacked_rows_independent  # noqa: E402
from swarm.compute.numclass import numerics_class  # noqa: E402


class OneBatch(Graph):
    """A graph whose products are one plain ggml batch, whatever its kernels do to a row's bits."""

    def mul_mat(self, w: object, x: object) -> object:
        return self.g.ggml_mul_mat(self.ctx, w, x)


class RowByRow(Graph):
    """A graph whose products are batches of one-row products ([I, 1, N]), Graph.mul_mat's other choice."""

    def mul_mat(self, w: object, x: object) -> object:
        g, n = self.g, int(x.contents.ne[1])  # type: ignore[attr-defined]
        y = g.ggml_mul_mat(self.ctx, w, g.ggml_reshape_3d(self.ctx, x, int(x.contents.ne[0]), 1, n))  # type: ignore[attr-defined]
        return g.ggml_reshape_2d(self.ctx, y, int(y.contents.ne[0]), n)


def product(kind: type[Graph], w: weights.Weight, x: np.ndarray) -> Callable[[], np.ndarray]:
    """A kept graph of `kind` for w times the rows of x: a function that runs it and returns the rows."""
    n, cols = x.shape
    gr = kind(8, keep=True)
    y = gr.mul_mat(gr.weight_slot(w), gr.input(cols, n))
    gr.output(y)
    gr.build()
    out = np.empty((n, w.rows), np.float32)

    def run() -> np.ndarray:
        gr.run([x], [out], [w])
        return out

    return run


def seconds(run: Callable[[], object], budget: float = 0.4) -> float:
    run()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget or len(times) < 5:
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(name: str, rows: int, cols: int, counts: list[int]) -> dict[str, object]:
    qtype = int(GGMLQuantizationType[name])
    w = weights.repacked(weights.Weight.of_bytes(probes.probe_weight(qtype, rows, cols), qtype, (rows, cols)))
    x = np.random.default_rng(1).standard_normal((max(counts), cols)).astype(np.float32)
    alone = np.concatenate([product(Graph, w, x[i : i + 1])().copy() for i in range(max(counts))])
    out: dict[str, object] = {"repacked": w.repack is not None, "rows": {}, "batch": {}, "keeps": True}
    for n in counts:
        rows_, plain = product(RowByRow, w, x[:n]), product(OneBatch, w, x[:n])
        out["keeps"] = bool(out["keeps"]) and np.array_equal(plain().view(np.uint32), alone[:n].view(np.uint32))
        out["rows"][n] = seconds(rows_)  # type: ignore[index]
        out["batch"][n] = seconds(plain)  # type: ignore[index]
    return out


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q5_K,Q4_0,IQ4_NL,F16,BF16")
    p.add_argument("--shape", default="8192x2048", help="the matrix, rows x columns (out x in)")
    p.add_argument("--rows", default="1,16,64", help="activation rows a product takes")
    p.add_argument("--threads", type=int, default=2)
    args = bench_args(p, argv)
    rows, cols = (int(v) for v in args.shape.lower().split("x"))
    counts = [int(v) for v in args.rows.split(",")]
    set_threads(args.threads)
    lines = [
        "## What a row's bits not depending on its batch costs the dense products (`bench/batch_kernels.py`)",
        "",
        f"Command: `{command('batch_kernels.py', args.argv)}`  ",
        f"Machine: {machine()}; {args.threads} threads; ggml: {numerics_class()}.",
        "",
        f"A {rows} x {cols} matrix of each type (in ggml's repacked layout where this CPU has one) times N rows: "
        "as N one-row products and as one plain ggml batch (its batched kernels: the repacked GEMM, tinyBLAS); "
        "swarm takes the batch where it keeps each row's bits (the probes' verdict), else the one-row products. "
        "ms a product, medians.",
        "",
        "| type | layout | one batch keeps a row's bits | swarm multiplies | "
        + " | ".join(f"{n} rows: row by row, one batch" for n in counts)
        + " |",
        "|---|---|---|---|" + "---:|" * len(counts),
    ]
    for name in args.types.split(","):
        m = measure(name, rows, cols, counts)
        qtype = int(GGMLQuantizationType[name])  # Graph.mul_mat's choice: what the probes found
        keeps = repacked_rows_independent(qtype) if m["repacked"] else probes.rows_independent(qtype)
        how = "one batch" if keeps else "row by row"
        cells = " | ".join(f"{1e3 * m['rows'][n]:.2f}, {1e3 * m['batch'][n]:.2f}" for n in counts)  # type: ignore[index]
        lines.append(f"| {name} | {'repacked' if m['repacked'] else 'as stored'} | {'yes' if m['keeps'] else 'no'} "
                     f"| {how} | {cells} |")  # fmt: skip
    publish("batch-kernels", "\n".join(lines), not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
