"""How honest answers of real ARM builds, and damaged ones, sit against the cross-class bound.

For every answer file recorded on an arm64 ggml build (tests/fixtures/numerics/, made with its record.py
under qemu-user), this machine computes its own answers for the same rows and slabs, and the bound of
coordinator/checks/tolerance.py for each row. Reported per file: the share of output elements whose bits differ
from this machine's, the largest |theirs - ours| / bound over the honest answers (an honest answer is
accepted up to SAFETY), and, for the damaged copies (1 % of each recorded expert's slab bytes with one bit
flipped; and a single flipped bit per slab), the smallest over experts of the largest ratio: above SAFETY,
that expert's damage is caught across classes.

    python bench/crossclass.py [--no-write]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _doc import command, machine, publish  # noqa: E402

from swarm.compute.numclass import numerics_class  # noqa: E402
from swarm.compute.slabs import load_slabs  # noqa: E402
from swarm.compute.store import ExpertStore  # noqa: E402
from swarm.coordinator.checks.tolerance import SAFETY, expert_bound  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


def _gguf(meta: dict) -> Path:
    for p in FIXTURES.rglob(meta["gguf"]):
        if hashlib.sha256(p.read_bytes()).hexdigest() == meta["gguf_sha256"]:
            return p
    raise SystemExit(f"no fixture GGUF {meta['gguf']} with the recorded SHA-256")


def measure(path: Path) -> str:
    with np.load(path) as z:
        a = {k: z[k] for k in z.files}
    meta = json.loads(str(a.pop("meta")))
    store = ExpertStore(load_slabs(_gguf(meta)).slabs)
    ids = [int(e) for e in a["expert_ids"]]
    counts = [int(n) for n in a["counts"]]
    per_row = [e for e, n in zip(ids, counts, strict=True) for _ in range(n)]
    differ = total = 0
    honest = 0.0
    damaged = {k: float("inf") for k in ("damaged_answers", "damaged_1bit_answers") if k in a}
    for i, layer in enumerate(int(x) for x in a["layers"]):
        rows = torch.from_numpy(a["rows"][i])
        ours = store.compute(layer, ids, counts, rows).double()
        theirs = torch.from_numpy(a["answers"][i]).double()
        differ += int((ours != theirs).sum())
        total += ours.numel()
        at = {e: [j for j, x in enumerate(per_row) if x == e] for e in ids}
        bound = torch.cat([expert_bound(store, layer, e, rows[at[e]], torch.float32) for e in ids])
        honest = max(honest, float(((theirs - ours).abs() / bound).max()))
        for key in damaged:
            ratio = (torch.from_numpy(a[key][i]).double() - ours).abs() / bound
            damaged[key] = min(damaged[key], min(float(ratio[at[e]].max()) for e in ids))
    feats = ", ".join(k for k, v in meta["ggml_features"].items() if v and k not in ("sve_cnt",))
    cells = [
        f"{damaged[k]:.3g}" if k in damaged else "-" for k in ("damaged_answers", "damaged_1bit_answers")
    ]
    return (
        f"| {meta['build']} ({feats}) | {meta['model']} | {differ / total:.2f} | {honest:.2g} | "
        f"{cells[0]} | {cells[1]} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    files = sorted((FIXTURES / "numerics").glob("*.npz"))
    lines = [
        "## Real ARM answers against the cross-class bound (`bench/crossclass.py`)",
        "",
        f"Command: `{command('crossclass.py', argv)}`  \nMachine: {machine()}, class {numerics_class()}; "
        f"accepted up to {SAFETY:g} x bound.",
        "",
        "| ARM build (ggml features) | model | elements that differ | honest: max diff / bound | 1 % of bytes "
        "rotted: min over experts of max diff / bound | one bit per slab: the same |",
        "|---|---|---:|---:|---:|---:|",
        *(measure(p) for p in files),
    ]
    publish("crossclass", "\n".join(lines), not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
