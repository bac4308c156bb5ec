"""Honest answers of one ggml build with their inner products, for bench/bound_builds.py: run with this x86
host's venv, with another x86 build of ggml first on PYTHONPATH, and under qemu-user inside the arm64 root
(deploy/arm/arm-root.sh) with each ARM build's node venv. numpy only: a node's venv has no torch.

    python bench/_bound_builds.py inputs DIR                # the GGUFs and rows every build multiplies
    python bench/_bound_builds.py record DIR OUT.npz        # this build's answers and inner products of them

`inputs` copies the fixture GGUFs (../shared/fixtures) into DIR, writes tiny synthetic ones (`swarm synth`)
for the expert types the fixtures lack, and the rows: made once, here, and carried to every build, so that
nothing depends on a random generator's or a quantizer's bits elsewhere. `record` computes, for every file,
both numerics and the calls of `calls` (every row of CALL_EXPERTS experts at once, as a prompt's call; one
row of each, as a decode call; the prompt's rows through the q8 wire; rows on which ARM's quantizer rounds an
element otherwise than x86's, where the experts take Q8_0 or Q8_K rows), the answer y and the inner products
[N, 2F] through swarm.compute.store's `compute_inner`, the node's own code path: a whole GGUF's experts
stacked (mul_mat_id).

Rows: the layer's input scaled by 0.01, 1 and 30, half of them with three outlier columns x50 (the fixtures'
own activations are of this order).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from swarm.compute.store import ExpertStore

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT.parent / "shared" / "fixtures"
FILES = (  # fixtures: F32, BF16, Q8_0, and Q4_K_M (Q4_K gate/up with Q6_K / Q4_K down)
    "qwen35moe-tiny/model-f32.gguf",
    "qwen35moe-tiny/model-bf16.gguf",
    "qwen35moe-quant/model-q8_0.gguf",
    "qwen35moe-quant/model-q4_k_m.gguf",
)
# expert types `swarm synth` writes that the fixtures lack and a projection checks (vec_dot_type F16, Q8_0 or
# Q8_K); synth's IQ2_XS and IQ1_M are not measured here
SYNTH = ("F16", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# one file of the 35B's layer shape (D 2048, F 512): sums over longer rows
SHAPE = ("qwen3.6-35b-a3b", "Q4_K")
CALL_EXPERTS = 4  # experts a call (spread over the layer, first and last included)
ROWS = 6  # rows an expert in the prompt call
SCALES = (0.01, 1.0, 30.0)


def neon_rows(x: np.ndarray, kind: int) -> np.ndarray:
    """Rows [n, D] as ggml's ARM build quantizes them to `kind` (Q8_0 or Q8_K), as float32 rows that this
    host's quantizer turns into those very blocks. Q8_0 (arch/arm/quants.c): d = amax / 127 and each value
    times 1 / d rounded to nearest even, where x86's AVX2 code multiplies by 127 / amax. Q8_K (ggml-quants.c's
    plain C, both): nearest_int(iscale·x) adds 1.5·2²³, which ARM's compiler fuses with the product (one
    rounding of the exact iscale·x) and x86's does not (the product rounded first)."""
    from swarm.proto.q8 import BLOCK, GGML_BLOCK, Q8_0, Q8Rows, float_rows, to_wire

    n, cols = x.shape
    blocks = x.reshape(n, -1, BLOCK[kind])
    if kind == Q8_0:
        d = (np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.rint(blocks * np.where(d > 0, np.float32(1) / d, np.float32(0)))
        return (q * d.astype(np.float16).astype(np.float32)).astype(np.float32).reshape(x.shape)
    top = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[..., None], axis=2)  # the first largest
    iscale = (np.float32(-127) / top).astype(np.float32)
    q = np.minimum(np.rint(iscale.astype(np.float64) * blocks.astype(np.float64)), 127)  # float64: exact
    made = np.zeros(blocks.shape[:2], GGML_BLOCK[kind])
    made["d"] = (np.float32(1) / iscale[..., 0]).astype(np.float32)
    made["qs"] = q
    made["bsums"] = q.reshape(n, -1, 16, 16).sum(axis=3)
    return float_rows(Q8Rows(kind, to_wire(made.view(np.uint8).reshape(n, -1), kind), cols))


def edge_rows(d: int, rows: int, seed: int, kind: int) -> np.ndarray:
    """`rows` rows [rows, d] of N(0, 1) that ARM's quantizer to `kind` makes into other blocks than this
    host's (an element within about an ulp of a step: about 1.3 in a million)."""
    from swarm.compute.rowquant import kernel_values

    weight = {8: 8, 15: 12}[kind]  # a weight type whose kernel takes that kind: Q8_0, Q4_K
    rng = np.random.default_rng(seed)
    found: list[np.ndarray] = []
    while sum(len(f) for f in found) < rows:
        x = rng.standard_normal((4000, d)).astype(np.float32)
        ours, theirs = kernel_values(x, weight), kernel_values(neon_rows(x, kind), weight)
        assert ours is not None and theirs is not None
        found.append(x[np.flatnonzero((theirs != ours).any(axis=1))])
    return np.concatenate(found)[:rows]


def _synth(path: Path, like: str, experts_type: str, **dims: int) -> None:
    from swarm.sharding.synth import synthesize
    from swarm.sharding.synth_spec import preset

    synthesize(path, preset(like, n_layers=2, experts_type=experts_type, n_vocab=768, seed=7, **dims))


def make_inputs(out: Path) -> None:
    from swarm.compute.rowquant import row_type, wire_rows
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore
    from swarm.proto.q8 import float_rows

    out.mkdir(parents=True, exist_ok=True)
    files = []
    for rel in FILES:
        name = rel.replace("/", "-").replace("model-", "")
        shutil.copyfile(FIXTURES / rel, out / name)
        files.append(name)
    for t in SYNTH:
        name = f"synth-qwen3moe-{t.lower()}.gguf"
        _synth(out / name, "qwen3moe-tiny", t, n_expert=8)
        files.append(name)
    like, t = SHAPE
    name = f"synth-35b-shape-{t.lower()}.gguf"
    _synth(out / name, like, t, n_expert=8, n_embd=2048, expert_ff=512, n_head=8, n_head_kv=2, head_dim=128)
    files.append(name)
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}
    for name in files:
        store = ExpertStore(load_slabs(out / name, verify=False).slabs, "cpu")
        d = int(store.hidden_size)
        n = CALL_EXPERTS * ROWS
        x = rng.standard_normal((len(store.layers()), n, d)).astype(np.float32)
        x *= np.float32(SCALES)[np.arange(n) % len(SCALES)][None, :, None]
        for i in range(x.shape[0]):
            for row in range(1, n, 2):
                x[i, row, rng.integers(0, d, 3)] *= 50
        arrays[name] = x
        for i, layer in enumerate(store.layers()):
            slab = store.slabs[next(k for k in store.held() if k[0] == layer)]
            kind = row_type(int(p.qtype) for p in (slab.gate, slab.up, slab.gate_up) if p is not None)
            wired = wire_rows(x[i], kind) if kind is not None else None
            if wired is not None:  # the float32 rows a node takes from the q8 wire's blocks
                arrays[f"{name}/wire/{layer}"] = float_rows(wired)
            if kind is not None:  # rows ARM's quantizer rounds otherwise, CALL_EXPERTS of them
                arrays[f"{name}/edge/{layer}"] = edge_rows(d, CALL_EXPERTS, seed=layer, kind=kind)
    np.savez(out / "rows.npz", **arrays)
    (out / "files.json").write_text(json.dumps(files))


def calls(store: ExpertStore, layer: int) -> list[tuple[str, list[int], list[int], np.ndarray]]:
    """(name, experts, counts, indices into the layer's rows) of the calls a layer: a prompt's (every row),
    a decode's (one row an expert), the prompt's rows as `--wire q8` delivers them (key `wire`), and rows one
    of whose elements ARM's quantizer rounds otherwise (key `edge`, where the experts take Q8_0 or Q8_K rows)."""
    held = sorted(e for n, e in store.held() if n == layer)
    picks = sorted({held[int(round(i))] for i in np.linspace(0, len(held) - 1, CALL_EXPERTS)})
    prompt = np.arange(len(picks) * ROWS)
    decode = np.arange(0, len(picks) * ROWS, ROWS)
    return [
        ("prompt", picks, [ROWS] * len(picks), prompt),
        ("decode", picks, [1] * len(picks), decode),
        ("wire", picks, [ROWS] * len(picks), prompt),
        ("edge", picks, [1] * len(picks), np.arange(len(picks))),
    ]


def record(inputs: Path, out: Path) -> None:
    from _arm_kernels import _meta  # (bench/ is on the path: this script's folder)

    from swarm.compute import ggml
    from swarm.compute.slabs import load_slabs
    from swarm.compute.store import ExpertStore
    from swarm.proto.numerics import Numerics

    ggml.set_threads(int(os.environ.get("BOUND_THREADS", "1")))
    files = json.loads((inputs / "files.json").read_text())
    arrays: dict[str, np.ndarray] = {}
    with np.load(inputs / "rows.npz") as z:
        rows = {k: z[k] for k in z.files}
    for name in files:
        store = ExpertStore(load_slabs(inputs / name, verify=False).slabs, "cpu")
        for i, layer in enumerate(store.layers()):
            for call, experts, counts, idx in calls(store, layer):
                x = np.ascontiguousarray(rows[name][i][idx])
                for numerics in (Numerics.NATIVE, Numerics.EXACT):
                    if call in ("wire", "edge"):
                        if f"{name}/{call}/{layer}" not in rows or numerics is Numerics.EXACT:
                            continue
                        x = np.ascontiguousarray(rows[f"{name}/{call}/{layer}"][idx])
                    y, inner = store.compute_inner(layer, experts, counts, x, numerics)
                    key = f"{name}/{layer}/{call}/{numerics.value}"
                    arrays[f"{key}/y"] = np.asarray(y, np.float32)
                    arrays[f"{key}/inner"] = inner
        print(f"{name}: {len(store.layers())} layers", flush=True)
    meta = _meta({"threads": int(os.environ.get("BOUND_THREADS", "1"))})
    np.savez_compressed(out, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    print(f"{out}: {meta['numerics_class']}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["inputs"] and len(argv) == 2:
        make_inputs(Path(argv[1]))
    elif argv[:1] == ["record"] and len(argv) == 3:
        record(Path(argv[1]), Path(argv[2]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
