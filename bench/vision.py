"""Seconds to encode one picture with swarm's vision tower against llama.cpp's mtmd, and the tower's peak memory.

    .venv/bin/python bench/vision.py [--blocks 2] [--runs 3] [--full-runs 1] [--workdir DIR] [--no-write]

The mmproj files are random-weight Qwen3.6 vision towers (bench/_vision_mmproj.py: width 1152, 16 heads, MLP
4304, patch 16, merge 2, out 2048, projector qwen3vl_merger) in F16 and Q8_0. On a 2-core machine the real
27-block tower takes minutes per 1,024-row picture, so the timed matrix runs the same tower cut to --blocks
blocks (the blocks are identical, so the per-block ratio is the tower's), and --full-runs runs of the real
27-block F16 file at 260 rows check it. Pictures of 640 x 416 (260 rows) and 1024 x 1024 (1,024 rows) need no
resize under either engine's smart resize; the bench checks that both encoded that many rows.

Each run is a fresh process per engine: swarm (bench/_vision_swarm.py: load_vision, prepare, encode_picture
timed, peak RSS) and llama-mtmd-cli (bench/_vision_llama.py: its "image slice encoded in N ms"), the two
engines alternating which goes first, same threads; medians. Goals: swarm >= 0.8x llama.cpp's speed; the
encoder's peak memory (peak RSS less that of the same process without the mmproj) <= 1.2x its file plus the
activations (bench/_vision_figures.activation_bytes). Figures go to the `bench:vision` section of
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _doc import command, machine, publish  # noqa: E402
from _vision_figures import (
    Case,
    memory_table,
    parts_table,
    picture_size,
    speed_table,
)  # noqa: E402
from _vision_llama import DEFAULT_CLI, encode_once  # noqa: E402
from _vision_mmproj import QWEN36, TowerShape, write_mmproj  # noqa: E402
from _vision_report import (  # noqa: E402
    MEMORY_BOUND,
    SPEED_GOAL,
    attention_table,
    findings,
)

from swarm.sharding.synth import synthesize  # noqa: E402
from swarm.sharding.synth_spec import preset  # noqa: E402

log = logging.getLogger("bench.vision")
HERE = Path(__file__).resolve().parent
# (file type, rows, threads, what-if): one thread only at 260 rows, where a run takes seconds rather than
# minutes; the batched-products what-if where swarm multiplies row by row (F16 on x86)
MATRIX = (
    ("f16", 260, 2, True),
    ("f16", 260, 1, False),
    ("f16", 1024, 2, True),
    ("q8_0", 260, 2, False),
    ("q8_0", 1024, 2, False),
)


def text_model(workdir: Path) -> Path:
    """The text GGUF llama-mtmd-cli loads beside the mmproj: Qwen3.6's width (2048), 2 layers."""
    path = workdir / "text-qwen36-2l.gguf"
    if not path.exists():
        spec = preset("qwen3.6-35b-a3b", n_layers=2, full_attention_interval=2, experts_type="Q4_K",
                      dense_type="Q8_0")  # fmt: skip
        synthesize(path, spec)
    return path


def picture(workdir: Path, tokens: int, shape: TowerShape) -> Path:
    """A smooth random picture (waves plus noise, fixed seed) that encodes to `tokens` rows."""
    import numpy as np
    from PIL import Image

    w, h = picture_size(tokens, shape)
    path = workdir / f"picture-{w}x{h}.png"
    if not path.exists():
        rng = np.random.default_rng(tokens)
        y, x = np.mgrid[0:h, 0:w]
        waves = [127 + 100 * np.sin(x / (17 + 7 * c) + y / (23 + 5 * c) + c) for c in range(3)]
        rgb = np.stack(waves, -1) + rng.normal(0, 20, (h, w, 3))
        Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(path)
    return path


def swarm_run(args: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "_vision_swarm.py"), *args], capture_output=True, text=True, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"_vision_swarm.py {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_case(case: Case, runs: int, mmproj: Path, pic: Path, text: Path, cli: Path) -> None:
    """`runs` pairs of one swarm and one llama.cpp encode, alternating which goes first; both must make the
    picture's merged grid."""
    w, h = picture_size(case.tokens, QWEN36)
    side = QWEN36.patch * QWEN36.merge
    grid = (h // side, w // side)
    engines = ["swarm", "llama"] + (["batched"] if case.what_if else [])
    for i in range(runs):
        case.load.append(os.getloadavg()[0])
        for engine in engines[i % len(engines) :] + engines[: i % len(engines)]:
            if engine == "llama":
                e = encode_once(cli, text, mmproj, pic, case.threads)
                if e.grid != grid:
                    raise RuntimeError(f"{case.label}: llama.cpp made grid {e.grid}, not {grid}")
                case.llama.append(e.seconds)
                continue
            r = swarm_run(
                [str(mmproj), str(pic), str(case.threads)] + (["--batched"] if engine == "batched" else [])
            )
            if tuple(r["grid"]) != grid or not r["finite"]:
                raise RuntimeError(f"{case.label}: swarm made grid {r['grid']} (finite: {r['finite']})")
            (case.batched if engine == "batched" else case.swarm).append(r)
        log.info("%s run %d: swarm %.2f s, llama.cpp %.2f s (load %.1f)", case.label, i + 1,
                 case.swarm[-1]["seconds"], case.llama[-1], case.load[-1])  # fmt: skip


def attention_check(runs: int) -> list[dict[str, Any]]:
    """One block's attention as encoder.attention ships it (4-D inputs: torch's flash kernel) and with the
    batch dimension taken off (3-D: its math backend), at both pictures' patch grids, 2 threads, alternating:
    median seconds and peak RSS growth."""
    out = []
    for tokens in (260, 1024):
        w, h = picture_size(tokens, QWEN36)
        grid = [str(h // QWEN36.patch), str(w // QWEN36.patch)]
        runs_by = {"3-D": [], "4-D": []}  # type: dict[str, list[dict[str, Any]]]
        for i in range(runs):
            for variant in ("3-D", "4-D") if i % 2 == 0 else ("4-D", "3-D"):
                extra = ["--3d"] if variant == "3-D" else []
                runs_by[variant].append(swarm_run(["--attention", *grid, "2", *extra]))
        for variant, rs in runs_by.items():
            out.append({
                "tokens": tokens, "variant": variant, "backend": rs[0]["backend"],
                "seconds": statistics.median(r["seconds"] for r in rs),
                "peak_growth": statistics.median(r["peak_growth"] for r in rs),
            })  # fmt: skip
        log.info("attention at %d rows: %s", tokens, out[-2:])
    return out


def section(cases: list[Case], shapes: dict[int, TowerShape], files: dict[tuple[str, int], int],
            baseline: dict[int, int], argv: list[str] | None, where: str,
            attention: list[dict[str, Any]]) -> str:  # fmt: skip
    lines = [
        "## Vision encoder: swarm vs llama.cpp's mtmd (one picture)",
        "",
        f"`{command('vision.py', argv)}` on {where}. llama.cpp: `llama-mtmd-cli` of commit 0c1e570 (the "
        'llama-cpp-python 0.3.36 build in /work/llamacpp-build), `--no-warmup`, its own "mtmd batch encoding done in '
        'N ms"; swarm: `load_vision(numerics=NATIVE, device=cpu)`, `encode_picture` timed (preprocessing '
        "excluded in both). Random-weight Qwen3.6 vision towers (width 1152, 16 heads, MLP 4304, patch 16, "
        "merge 2, out 2048, qwen3vl_merger), each run a fresh process per engine, engines alternating, medians. "
        "Both engines made the same merged grid (13 x 20 = 260, 32 x 32 = 1,024 rows) in every run. The machine "
        "is shared: the load average (1 min, 2 cores) before each run pair is beside the figures; at loads above 2 "
        "neither engine gains from a second thread, so compare the engines within a row, not rows with each other. "
        "The timed matrix runs the tower cut to --blocks blocks (its blocks are identical, so their ratio is the "
        "tower's; the merger weighs more than in 27 blocks); the 27-block row is the real depth.",
        "",
        *speed_table(cases, SPEED_GOAL),
        "",
        "Where swarm's encode goes (median seconds per part, GFLOP/s in brackets; `ln1+attn_qkv`, `attn_out`, "
        "`ln2+ffn`, `merger`: one ggml graph per call, `attention`: torch's scaled_dot_product_attention with "
        "the 2-D RoPE; `other`: Python, position grid, copies), beside llama.cpp's whole encode:",
        "",
        *parts_table(cases, shapes),
        "",
        "Peak memory of swarm's encoder (2 threads): peak RSS (VmHWM) of a process that loads the mmproj and "
        "encodes the picture, less that of the same process (interpreter, torch, swarm imported) without the "
        "mmproj; activations estimated from the code (`bench/_vision_figures.activation_bytes`: pixels and patch "
        "rows, plus the wider of a block's MLP chain and its attention step).",
        "",
        *memory_table(cases, shapes, files, baseline, MEMORY_BOUND),
        "",
        *attention_table(attention),
        "",
        *findings(cases, shapes, files, baseline),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/swarm-bench-vision"))
    ap.add_argument("--blocks", type=int, default=2, help="ViT blocks of the timed matrix's towers")
    ap.add_argument("--runs", type=int, default=3, help="run pairs per configuration")
    ap.add_argument(
        "--full-runs", type=int, default=1, help="run pairs of the 27-block F16 tower at 260 rows"
    )
    ap.add_argument("--cli", type=Path, default=DEFAULT_CLI, help="llama-mtmd-cli")
    ap.add_argument("--no-write", action="store_true", help="print the section, leave docs/BENCHMARKS.md")
    ap.add_argument("--from-json", type=Path, help="publish the figures a run saved (WORKDIR/vision.json)")
    ap.add_argument("--attention-only", action="store_true",
                    help="run only the attention check, add it to WORKDIR/vision.json and publish")  # fmt: skip
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.from_json:
        republish(args.from_json, not args.no_write)
        return
    if args.attention_only:
        path = args.workdir / "vision.json"
        saved = json.loads(path.read_text())
        saved["attention"] = attention_check(args.runs)
        path.write_text(json.dumps(saved))
        republish(path, not args.no_write)
        return
    if not args.cli.exists():
        raise SystemExit(f"{args.cli} is not built: cmake --build <llama.cpp build> --target llama-mtmd-cli")
    args.workdir.mkdir(parents=True, exist_ok=True)
    plan = [
        (kind, tokens, threads, what_if, args.blocks, args.runs) for kind, tokens, threads, what_if in MATRIX
    ]
    if args.full_runs:
        plan.append(("f16", 260, 2, False, QWEN36.n_layer, args.full_runs))
    shapes = {blocks: replace(QWEN36, n_layer=blocks) for *_, blocks, _ in plan}
    text = text_model(args.workdir)
    files: dict[tuple[str, int], int] = {}
    baseline = {t: swarm_run(["--baseline", str(t)])["peak_rss"] for t in sorted({p[2] for p in plan})}
    cases = []
    for kind, tokens, threads, what_if, blocks, runs in plan:
        mmproj = write_mmproj(args.workdir / f"mmproj-qwen36-d{blocks}-{kind}.gguf", kind, shapes[blocks])
        files[(kind, blocks)] = mmproj.stat().st_size
        case = Case(kind, tokens, threads, blocks, what_if)
        run_case(case, runs, mmproj, picture(args.workdir, tokens, QWEN36), text, args.cli)
        cases.append(case)
        saved: dict[str, Any] = {
            "cases": [asdict(c) for c in cases],
            "files": [[k, b, n] for (k, b), n in files.items()],
            "baseline": baseline,
            "argv": sys.argv[1:] if argv is None else argv,
            "machine": machine(),
        }
        (args.workdir / "vision.json").write_text(json.dumps(saved))  # a later --from-json publishes it
    saved["attention"] = attention = attention_check(args.runs)
    (args.workdir / "vision.json").write_text(json.dumps(saved))
    publish("vision", section(cases, shapes, files, baseline, argv, machine(), attention), not args.no_write)


def republish(path: Path, write: bool) -> None:
    """Publish the section from the figures a run saved (its command line and machine line included)."""
    saved = json.loads(path.read_text())
    cases = [Case(**c) for c in saved["cases"]]
    shapes = {c.blocks: replace(QWEN36, n_layer=c.blocks) for c in cases}
    files = {(k, int(b)): n for k, b, n in saved["files"]}
    baseline = {int(t): n for t, n in saved["baseline"].items()}
    argv = [a for a in saved["argv"] if a != "--no-write"]  # it decides where figures go, not what they are
    text = section(cases, shapes, files, baseline, argv, saved["machine"], saved.get("attention", []))
    publish("vision", text, write)


if __name__ == "__main__":
    main()
