"""ARM builds of ggml against x86, kernel by kernel: how their bits differ, and whether a row's bits depend
on its batch with and without swarm.compute.probes' choice.

Three arm64 builds of ggml-python (plain NEON, +dotprod, +dotprod+i8mm), each in its node venv of the arm64
root that deploy/arm/arm-root.sh makes and run under qemu-user with a CPU model that has its features, and
this machine's own build multiply the same weights and rows (bench/_arm_kernels.py: made once here, carried
to every build). Per kernel and weight type: the share of output elements whose bits differ and the largest
difference in float32 ulp, against x86 and between the ARM builds; per build and type, whether every row
of a batch of 2, 4, 7 and 8 equals the row alone, ggml's own pick of kernel (weight as stored) against
what a node runs. Then a 4-layer swarm with one ARM node of each build beside x86 nodes, at default
settings: every node honest, then one damaged node of each kind (bench/_arm_swarm.py): who is banned, KL
and greedy text against in process. Emulation is slow, so nothing is timed.

    sudo ARM_ROOT=/work/arm/root .venv/bin/python bench/arm.py [--builds neon,dotprod,dotprod-i8mm]
        [--no-install] [--no-swarm] [--no-write]

Needs root (chroot) and the root's node venvs (`deploy/arm/arm-root.sh all`); unless --no-install, each
build's venv is reinstalled from this checkout first (`arm-root.sh node BUILD`), so the ARM runs use the
code the x86 run does. Written to `bench:arm` in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "fixtures" / "numerics"))

from _arm_kernels import COUNTS, TYPES, load  # noqa: E402
from _doc import command, machine, publish  # noqa: E402
from record import differences  # noqa: E402

from swarm.compute.probes import batch_keeps_rows  # noqa: E402

log = logging.getLogger("bench.arm")
SCRIPT = ROOT / "deploy" / "arm" / "arm-root.sh"
BUILDS = ("neon", "dotprod", "dotprod-i8mm")
WORK = "/tmp/swarm-arm-bench"  # inside the root
KERNELS = {
    "batch/alone": "one row alone (vec_dot)",
    "batch/8": "8 rows in one mul_mat, weight as stored (ggml's pick: tinyBLAS, 2-row int8-matmul, vec_dot)",
    "node/8": "8 rows through Graph.mul_mat as a node holds the weight (repacked where the build has a "
    "layout; rows one by one where the probe says so)",
    "stack/8": "an expert stack (mul_mat_id, SwiGLU, down), 8 rows over 2 experts",
}


def arm_root() -> Path:
    return Path(os.environ.get("ARM_ROOT", "/var/lib/swarm-arm/root"))


def run_builds(builds: list[str], install: bool) -> dict[str, Path]:
    """Every build's record file (host paths); x86 from this machine's venv."""
    root = arm_root()
    if os.geteuid() != 0:
        raise SystemExit("bench/arm.py runs the ARM builds through chroot: run it as root")
    for b in builds:
        if not (root / f"opt/node-{b}/bin/python").exists():
            raise SystemExit(f"no node venv for {b} in {root}: run `deploy/arm/arm-root.sh all` first")
    work = root / WORK.lstrip("/")
    work.mkdir(parents=True, exist_ok=True)
    helper = [sys.executable, str(ROOT / "bench" / "_arm_kernels.py")]
    subprocess.run([*helper, "inputs", str(work / "inputs.npz")], check=True)
    subprocess.run([*helper, "record", str(work / "inputs.npz"), str(work / "x86.npz")], check=True)
    env = {**os.environ, "ARM_ROOT": str(root)}
    out = {"x86": work / "x86.npz"}
    for b in builds:
        if install:
            subprocess.run([str(SCRIPT), "node", b], check=True, env=env)
        log.info("recording %s under qemu", b)
        subprocess.run(
            [str(SCRIPT), "run", b, f"python bench/_arm_kernels.py record {WORK}/inputs.npz {WORK}/{b}.npz"],
            check=True,
            env=env,
        )
        out[b] = work / f"{b}.npz"
    return out


def _cell(a: np.ndarray, b: np.ndarray) -> str:
    if np.array_equal(a.view(np.uint32), b.view(np.uint32)):
        return "="
    d = differences(a, b)
    return f"{100 * d['frac_differ']:.0f} % / {d['max_ulp']}"


def bits_tables(runs: dict[str, tuple[dict, dict[str, np.ndarray]]]) -> list[str]:
    """Per kernel: a table of types by pairs of builds, '=' or 'share of elements differing / max ulp'."""
    arm = [b for b in runs if b != "x86"]
    pairs = [(b, "x86") for b in arm] + [(a, b) for i, a in enumerate(arm) for b in arm[i + 1 :]]
    lines = []
    for key, what in KERNELS.items():
        lines += [
            "",
            f"**{what}**",
            "",
            "| type | " + " | ".join(f"{a} vs {b}" for a, b in pairs) + " |",
            "|---|" + "---:|" * len(pairs),
        ]
        for name in TYPES:
            k = f"{name}/{key}"
            if any(k not in runs[b][1] for b in runs):
                continue
            cells = [_cell(runs[a][1][k], runs[b][1][k]) for a, b in pairs]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _keeps(arrays: dict[str, np.ndarray], name: str, kernel: str) -> bool:
    batched = {n: arrays[f"{name}/{kernel}/{n}"] for n in COUNTS}
    return batch_keeps_rows(batched, arrays[f"{name}/{kernel}/alone"])


def rows_table(runs: dict[str, tuple[dict, dict[str, np.ndarray]]]) -> list[str]:
    """Per type and build: rows keep their bits in a batch? weight as stored / as the node runs it / the
    expert stack; with the probe's verdict and whether the build repacks the type."""
    lines = [
        "| type | " + " | ".join(runs) + " |",
        "|---|" + "---|" * len(runs),
    ]
    for name in TYPES:
        cells = []
        for meta, arrays in runs.values():
            if f"{name}/batch/alone" not in arrays:
                cells.append("no kernel")
                continue
            raw, node, stack = (_keeps(arrays, name, k) for k in ("batch", "node", "stack"))
            marks = ("¹" if not meta["rows_independent"][name] else "") + (
                "ʳ" if meta["repacked"][name]["dense"] else ""
            )
            cells.append(
                f"{'yes' if raw else 'NO'} / {'yes' if node else 'NO'}{marks} / {'yes' if stack else 'NO'}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def report(files: dict[str, Path], swarm: list[tuple[str, dict]] | None, argv: list[str] | None) -> str:
    runs = {b: load(p) for b, p in files.items()}
    builds = "; ".join(
        f"{b}: {m['numerics_class']}" + (f", QEMU_CPU={m['qemu_cpu']}" if m["qemu_cpu"] else "")
        for b, (m, _) in runs.items()
    )
    lines = [
        "## ARM builds against x86, kernel by kernel (`bench/arm.py`)",
        "",
        f"Command: `{command('arm.py', argv)}`  ",
        f"Machine: {machine()}; the ARM builds under qemu-user (deploy/arm/arm-root.sh), ggml on 1 thread.  ",
        f"Builds: {builds}.",
        "",
        "The same weights (each type's, random, quantized once on x86) and 8 rows on every build. A cell: `=` "
        "where every bit is the same, else the share of output elements whose bits differ / the largest "
        "difference in float32 ulp.",
        *bits_tables(runs),
        "",
        "**Whether every row of a batch (2, 4, 7 and 8 rows) has the bits it has alone**: weight as stored "
        "in one mul_mat (ggml's pick of kernel, without the probe's choice) / the node's product "
        "(Graph.mul_mat, with it) / the expert stack. ¹ the probe found the type's rows changed by a batch "
        "on that build, and the node multiplies them one at a time; ʳ the build repacks the type (its "
        "products take one row at a time anyway).",
        "",
        *rows_table(runs),
    ]
    if swarm is not None:
        from _arm_swarm import HOLD, swarm_lines

        lines += [
            "",
            "**A 4-layer swarm with ARM nodes beside x86 ones** (the qwen35moe Q4_K_M fixture, loopback, default "
            "settings; bench/_arm_swarm.py): experts "
            + ", ".join(f"{v} on {k}" for k, v in HOLD.items())
            + ", all 8 on a second x86 node (replicas take turns; the ARM nodes serve the prompt). A damaged node "
            "serves a GGUF whose layer-0 expert weights differ under the same header. Each run a fresh "
            "coordinator, a 12-token prompt's logits and greedy tokens against in process. A position moved "
            "by more than 1e-4 moved by a step: ggml rounds a product's input rows to 8 bits, and an element a "
            "few ulp off (the ARM node's own sums, or the layer's input) can round the other way.",
            "",
            *swarm_lines(swarm),
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--builds", default=",".join(BUILDS), help="comma-separated ARM builds")
    p.add_argument("--no-install", action="store_true", help="use the node venvs as they are")
    p.add_argument("--no-swarm", action="store_true", help="the kernels only")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    builds = [b for b in args.builds.split(",") if b]
    unknown = set(builds) - set(BUILDS)
    if unknown:
        p.error(f"unknown builds {sorted(unknown)} (known: {', '.join(BUILDS)})")
    files = run_builds(builds, install=not args.no_install)
    swarm = None
    if not args.no_swarm:
        from _arm_swarm import run_swarm

        swarm = run_swarm(arm_root(), WORK, builds)
    publish("arm", report(files, swarm, argv), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
