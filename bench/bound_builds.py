"""The projections' tolerance against honest answers of other ggml builds: x86 AVX2 (this host's setup
build), x86 AVX-512, and the ARM generations bench/arm.py covers, the coordinator being this process.

Every build multiplies the same GGUFs and rows (bench/_bound_builds.py: the fixtures' F32, BF16, Q8_0 and
Q4_K_M files, synthetic ones for F16, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS, and one of the 35B's layer shape) as
a node does (swarm.compute.store `compute_inner`: a prompt's call, a decode call, the prompt's rows as the q8
wire delivers them, and rows on which ARM's quantizers round an element otherwise than x86's; native
and exact numerics), and this process checks every answer as a coordinator checks a node's
(swarm.coordinator.checks.projection): per build and weight type, the largest residual as a share of the
tolerance τ of each product on its own (gate, up: r·g against (Wᵀr)·x̂ with τ = 8·u·‖W‖_F·‖x̂‖; down: r·y
against (W_dᵀr)·ĥ, ĥ from the node's g and u by this build's swiglu), and of the two checks as the
coordinator runs them (gate and up in one, then down; with the REACH allowance for elements of x and h next
to a rounding step where the node's numerics class is not this one's, and without it). A ratio above 1 is a
false alarm.

    python bench/bound_builds.py [--x86 NAME=GGML_PACKAGE_DIR ...] [--arm neon,dotprod,dotprod-i8mm]
        [--no-record] [--no-write]

--x86: another build of ggml-python for this host (a folder holding its `ggml` package and its
`ggml_python-*.dist-info`), put first on PYTHONPATH of this venv's Python. --arm: each build's node venv in
the arm64 root of deploy/arm/arm-root.sh (ARM_ROOT), run under qemu-user with its QEMU_CPU; needs root.
--no-record: the records the last run left in the work folder. Written to `bench:bound-builds` in
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _arm_kernels import load  # noqa: E402
from _bound_builds import calls  # noqa: E402
from _doc import command, machine, publish  # noqa: E402

from swarm.compute.ffn import swiglu_rows  # noqa: E402
from swarm.compute.numclass import numerics_class  # noqa: E402
from swarm.compute.slabs import load_slabs  # noqa: E402
from swarm.compute.store import ExpertStore  # noqa: E402
from swarm.coordinator.checks import projection as P  # noqa: E402
from swarm.proto.numerics import Numerics  # noqa: E402
from swarm.sharding.slabs import SlabTensor  # noqa: E402

log = logging.getLogger("bench.bound_builds")
SCRIPT = ROOT / "deploy" / "arm" / "arm-root.sh"
ARM_BUILDS = ("neon", "dotprod", "dotprod-i8mm")
WORK = "/tmp/swarm-bound-builds"  # inside the arm64 root where ARM builds run, else on this host
TYPE_NAMES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    8: "Q8_0",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    23: "IQ4_XS",
    30: "BF16",
}


def arm_root() -> Path:
    return Path(os.environ.get("ARM_ROOT", "/var/lib/swarm-arm/root"))


def work_dir(arm: list[str]) -> Path:
    return arm_root() / WORK.lstrip("/") if arm else Path(WORK)


def run_builds(work: Path, x86: dict[str, Path], arm: list[str]) -> None:
    """Each build's record file in `work` (x86.npz for this venv's build)."""
    helper = [sys.executable, str(ROOT / "bench" / "_bound_builds.py")]
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([*helper, "inputs", str(work)], check=True)
    subprocess.run([*helper, "record", str(work), str(work / "x86.npz")], check=True)
    for name, package in x86.items():
        env = {**os.environ, "PYTHONPATH": f"{package}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run([*helper, "record", str(work), str(work / f"{name}.npz")], check=True, env=env)
    if arm and os.geteuid() != 0:
        raise SystemExit("the ARM builds run through chroot: run as root")
    for b in arm:
        if not (arm_root() / f"opt/node-{b}/bin/python").exists():
            raise SystemExit(f"no node venv for {b} in {arm_root()}: deploy/arm/arm-root.sh all")
        log.info("recording %s under qemu", b)
        # the checkout is mounted read-only at its own path inside the root (arm-root.sh mounts)
        cmd = f"python {ROOT}/bench/_bound_builds.py record {WORK} {WORK}/{b}.npz"
        subprocess.run(
            [str(SCRIPT), "run", b, cmd], check=True, env={**os.environ, "ARM_ROOT": str(arm_root())}
        )


@dataclass
class Worst:
    """The largest ratio seen per (weight type, check), and the rows over 1."""

    ratio: dict[tuple[str, str], float] = field(default_factory=dict)
    alarms: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    overflowed: int = 0  # rows whose answer is not finite (F16 rows past 65504): no check can pass them
    finite: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # the rows of the call being added
    # per check, each row's tolerance with the allowance over the tolerance without (another class only)
    widened: dict[str, list[np.ndarray]] = field(default_factory=lambda: {"gate/up": [], "down": []})

    def widening(self, check: str) -> str:
        """The share of rows whose tolerance the allowance widened, and the largest factor; '-' where none
        applies."""
        got = np.concatenate(self.widened[check]) if self.widened[check] else np.zeros(0)
        got = got[np.isfinite(got)]
        return f"{(got > 1.001).mean():.3f} / {got.max():.0f}x" if got.size else "-"

    def add(self, kind: str, check: str, ratios: np.ndarray) -> None:
        ratios = ratios[self.finite]
        worst = float(np.max(ratios)) if ratios.size else 0.0
        self.ratio[(kind, check)] = max(self.ratio.get((kind, check), 0.0), worst)
        self.alarms[check] = self.alarms.get(check, 0) + int((~(ratios <= 1.0)).sum())


def _name(qtype: int) -> str:
    return TYPE_NAMES.get(int(qtype), str(int(qtype)))


def _one(
    products: np.ndarray, r: np.ndarray, parts: list[tuple[SlabTensor, SlabTensor | None]], per_row: list[int],
    x: np.ndarray, native: bool,
) -> np.ndarray:  # fmt: skip
    """Residual / τ of one matrix's products [n, cols] against its own projection, each row with its
    expert's matrix (`parts`, indexed by per_row)."""
    vs, norms, bias = [], [], []
    for part, b in parts:
        v, sq = P._project(part, r)
        vs.append(v)
        norms.append(np.sqrt(sq))
        bias.append(r @ P._values(b).reshape(-1).astype(np.float64) if b is not None else np.zeros(len(r)))
    xq = P._act(x, int(parts[0][0].qtype), native)
    idx = np.asarray(per_row)
    return P._ratio(products, r, np.stack(bias)[idx], [(xq, np.stack(vs)[idx])], np.asarray(norms)[idx])


def measure(work: Path, record: Path, worst: Worst) -> dict:
    """Every answer of one build's record checked here; returns its meta."""
    meta, arrays = load(record)
    other = meta["numerics_class"] != numerics_class()
    with np.load(work / "rows.npz") as z:
        rows = {k: z[k] for k in z.files}
    for name in sorted({k.split("/")[0] for k in arrays}):
        store = ExpertStore(load_slabs(work / name, verify=False).slabs, "cpu", stacked=False)
        checks = P.Projections(store, projections=1, seed=0)
        shape = " (D 2048, F 512)" if "35b" in name else ""
        for i, layer in enumerate(store.layers()):
            for call, experts, counts, idx in calls(store, layer):
                for numerics in (Numerics.NATIVE, Numerics.EXACT):
                    key = f"{name}/{layer}/{call}/{numerics.value}"
                    if f"{key}/y" not in arrays:
                        continue
                    source = rows[f"{name}/{call}/{layer}"] if call in ("wire", "edge") else rows[name][i]
                    answer = Answer(experts, counts, np.ascontiguousarray(source[idx]), arrays[f"{key}/y"],
                                    arrays[f"{key}/inner"], numerics is Numerics.NATIVE)  # fmt: skip
                    worst.finite = np.isfinite(answer.y).all(axis=1) & np.isfinite(answer.inner).all(axis=1)
                    worst.overflowed += int((~worst.finite).sum())
                    worst.rows += int(worst.finite.sum())
                    suffix = f"{shape}, {numerics.value}"
                    if call != "edge":
                        _products(worst, store, checks, layer, answer, suffix)
                    _checks(worst, store, checks, layer, answer, suffix, other, call != "edge")
    return meta


@dataclass(frozen=True)
class Answer:
    """One call of a record: the rows sent [N, D], a node's answer [N, D] and inner products [N, 2F]."""

    experts: list[int]
    counts: list[int]
    x: np.ndarray
    y: np.ndarray
    inner: np.ndarray
    native: bool


def _products(
    worst: Worst, store: ExpertStore, checks: P.Projections, layer: int, a: Answer, suffix: str
) -> None:
    """Each product on its own against its matrix's projection (gate and up against x̂, down against ĥ)."""
    f = a.inner.shape[1] // 2
    per_row = [k for k, n in enumerate(a.counts) for _ in range(n)]
    slabs = [store.slabs[(layer, e)] for e in a.experts]
    r_gu, r_d = checks.secret(int(a.x.shape[1]), f)
    h = swiglu_rows(np.ascontiguousarray(a.inner))
    for what, products, r, rows in (
        ("gate", a.inner[:, :f], r_gu[:, :f], a.x),
        ("up", a.inner[:, f:], r_gu[:, f:], a.x),
        ("down", a.y, r_d, h),
    ):
        parts = [(getattr(s, what), getattr(s, f"{what}_bias")) for s in slabs]
        assert all(p is not None for p, _ in parts), f"no {what} slab (a gate_up file)"
        ratio = _one(products, r, parts, per_row, rows, a.native)
        worst.add(_name(parts[0][0].qtype) + suffix, what, ratio)


def _checks(
    worst: Worst, store: ExpertStore, checks: P.Projections, layer: int, a: Answer, suffix: str, other: bool,
    natural: bool,
) -> None:  # fmt: skip
    """The two checks as the coordinator runs them, with the allowance for another class and without;
    `natural`: rows not chosen for an element next to a step (their widening of τ is counted)."""
    members, at = [], 0
    for e, n in zip(a.experts, a.counts, strict=True):
        members.append((at, n, checks.vectors(layer, e)))
        at += n
    slab = store.slabs[(layer, a.experts[0])]
    gate_up = "+".join(_name(p.qtype) for p in (slab.gate, slab.up) if p is not None) + suffix
    down = _name(slab.down.qtype) + suffix  # type: ignore[union-attr]
    gu, d = checks._group(a.x, a.y, a.inner, members, a.native, 0.0, other)
    worst.add(gate_up, "gate/up check", gu)
    worst.add(down, "down check", d)
    if other:
        plain_gu, plain_d = checks._group(a.x, a.y, a.inner, members, a.native, 0.0, False)
        worst.add(gate_up, "gate/up, no REACH", plain_gu)
        worst.add(down, "down, no REACH", plain_d)
        with np.errstate(divide="ignore", invalid="ignore"):  # the same residual over either tolerance
            if not natural:
                return
            worst.widened["gate/up"].append((plain_gu / gu)[worst.finite])
            worst.widened["down"].append((plain_d / d)[worst.finite])


def differing(work: Path, build: str) -> float:
    """The share of answer and inner-product elements whose bits differ from this host's build's."""
    _, ours = load(work / "x86.npz")
    _, theirs = load(work / f"{build}.npz")
    differ = total = 0
    for k, a in ours.items():
        b = theirs[k]
        differ += int((a.view(np.uint32) != b.view(np.uint32)).sum())
        total += a.size
    return differ / total


def report(work: Path, builds: list[str], argv: list[str] | None) -> str:
    results: dict[str, tuple[dict, Worst]] = {}
    for b in builds:
        worst = Worst()
        with np.errstate(over="ignore", invalid="ignore"):  # (the rows that overflowed on the node)
            meta = measure(work, work / f"{b}.npz", worst)
        results[b] = (meta, worst)
    kinds = sorted(
        {k for _, w in results.values() for k, c in w.ratio if c == "gate"},
        key=lambda k: (k.endswith("exact"), k),
    )
    lines = [
        "## The projections' tolerance against honest answers of other builds (`bench/bound_builds.py`)",
        "",
        f"Command: `{command('bound_builds.py', argv)}`  ",
        f"Machine: {machine()}; the coordinator: this process, class {numerics_class()}.  ",
        "Builds: "
        + "; ".join(
            f"{b}: {m['numerics_class']}" + (f", QEMU_CPU={m['qemu_cpu']}" if m["qemu_cpu"] else "")
            for b, (m, _) in results.items()
        )
        + ".",
        "",
        "Largest honest residual / τ, per weight type of the matrix and numerics: each product on its own "
        "(gate / up / down: r·g against (Wᵀr)·x̂ with x̂ as this host's quantizer makes it, no allowance), "
        "over the calls of every file carrying the type (a prompt's, a decode's, the q8 wire's rows; every "
        "MoE layer of a file), the rows on which ARM's quantizer rounds otherwise left out (they are in the "
        "second table).",
        "",
        "| weight type | " + " | ".join(results) + " |",
        "|---|" + "---:|" * len(results),
    ]
    for k in kinds:
        cells = []
        for _, w in results.values():
            got = [w.ratio.get((k, c)) for c in ("gate", "up", "down")]
            cells.append(" / ".join("-" if v is None else f"{v:.3f}" for v in got))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The checks as the coordinator runs them (gate and up in one check, down; for a node of another "
        "numerics class with the REACH allowance for elements of x and h next to a rounding step, and "
        "without it for comparison): the largest residual / τ over every type, and the rows over 1 (false "
        "alarms, with the allowance).",
        "",
        "| build | elements whose bits differ from x86's | rows checked (not finite) | gate/up check | down check | gate/up without REACH | down without REACH "
        "| false alarms (without REACH) "
        "| rows whose τ the allowance widened (share / most), gate/up | down |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, (_, w) in results.items():

        def top(check: str, w: Worst = w) -> str:
            got = [v for (_, c), v in w.ratio.items() if c == check]
            return f"{max(got):.3f}" if got else "-"

        alarms = f"{w.alarms.get('gate/up check', 0) + w.alarms.get('down check', 0)}"
        if "down, no REACH" in w.alarms:
            alarms += f" ({w.alarms.get('gate/up, no REACH', 0) + w.alarms['down, no REACH']})"
        lines.append(f"| {b} | {differing(work, b):.2f} | {w.rows} ({w.overflowed}) | {top('gate/up check')} | {top('down check')} | "
                     f"{top('gate/up, no REACH')} | {top('down, no REACH')} | {alarms} | "
                     f"{w.widening('gate/up')} | {w.widening('down')} |")  # fmt: skip
    if any(w.overflowed for _, w in results.values()):
        lines += [
            "",
            "Rows not finite: answers that overflowed on the build that computed them (F16 weights take h as "
            "F16, and rows at 30x with outlier columns make h pass 65504); no check passes them, and they "
            "are left out of the figures above.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--x86", action="append", default=[], metavar="NAME=DIR",
                   help="another x86 ggml-python build: a folder with its ggml package and dist-info")  # fmt: skip
    p.add_argument("--arm", default="", help="comma-separated ARM builds (neon, dotprod, dotprod-i8mm)")
    p.add_argument("--no-record", action="store_true", help="check the records the last run left")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    arm = [b for b in args.arm.split(",") if b]
    unknown = set(arm) - set(ARM_BUILDS)
    if unknown:
        p.error(f"unknown ARM builds {sorted(unknown)} (known: {', '.join(ARM_BUILDS)})")
    x86 = dict(s.split("=", 1) for s in args.x86)
    work = work_dir(arm)
    if not args.no_record:
        run_builds(work, {k: Path(v) for k, v in x86.items()}, arm)
    builds = ["x86", *x86, *arm]
    publish("bound-builds", report(work, builds, argv), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
