"""Products of one ggml build, kernel by kernel, for bench/arm.py: run on this x86 host and, under qemu-user,
inside the arm64 root (deploy/arm/arm-root.sh) with each ARM build's node venv. numpy only: a node's venv
has no torch.

    python bench/_arm_kernels.py inputs OUT.npz           # the weights and rows every build multiplies
    python bench/_arm_kernels.py record INPUTS.npz OUT.npz   # this build's products of them
    python bench/_arm_kernels.py probe OUT.npz [TYPE ...]    # swarm.compute.probes' own products (a fixture)

The inputs are made once, on one machine, and carried to every build: ggml's quantizers are plain C whose
float rounding may differ between compilers and architectures (contracted multiply-adds), and the figures
are about the products alone. For each weight type, `record` multiplies the same 8 rows by:

- `alone`: each row alone (ggml's one-row vec_dot);
- `batch`: the first n rows in one mul_mat, weight as stored (ggml picks: tinyBLAS, 2-row int8-matmul
  kernels, or vec_dot row by row), n = 2, 4, 7, 8;
- `node`: the same through swarm.compute.graph (Graph.mul_mat on the weight as a node holds it: ggml's
  repacked copy where the build has one, rows one by one where the probe says a batch changes them);
- `stack`: an expert stack through ffn.moe_rows (ggml_mul_mat_id, SwiGLU and down), as a node multiplies
  a layer's experts, rows alternating between 2 experts.

Sizes: D model width (the dense product's input too), DENSE_OUT the dense product's output rows, F expert
width, E experts, N rows.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

D, DENSE_OUT, F, E, N = 512, 256, 256, 2, 8
COUNTS = (2, 4, 7, 8)  # swarm.compute.probes.PROBE_ROWS: even counts take ggml's 2-row kernels
# every type `swarm synth` writes and real Qwen files use (tests/test_kernels.py's list)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ4_XS", "IQ4_NL", "IQ2_XS", "IQ1_M")  # fmt: skip
# the probe fixture: the types ggml gives 2-row int8-matmul kernels on ARM, and some it does not
PROBE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q5_K", "F16", "F32", "BF16")
FEATURES = ("neon", "arm_fma", "dotprod", "matmul_int8", "sve", "llamafile", "avx2", "avx512")


def make_inputs(out: Path) -> None:
    from gguf import GGMLQuantizationType

    from swarm.compute import probes

    arrays: dict[str, np.ndarray] = {
        "x": np.random.default_rng(100).standard_normal((N, D)).astype(np.float32),
    }
    for i, name in enumerate(TYPES):
        q = int(GGMLQuantizationType[name])
        arrays[f"{name}/dense"] = probes.probe_weight(q, DENSE_OUT, D, seed=10 * i)
        for j, (part, rows, cols) in enumerate((("gate", E * F, D), ("up", E * F, D), ("down", E * D, F))):
            arrays[f"{name}/{part}"] = probes.probe_weight(q, rows, cols, seed=10 * i + j + 1)
    np.savez(out, **arrays)


def _features() -> dict[str, int]:
    from swarm.compute.ggml import ggml_lib

    g = ggml_lib()
    return {f: int(getattr(g, f"ggml_cpu_has_{f}")()) for f in FEATURES if hasattr(g, f"ggml_cpu_has_{f}")}


def _meta(extra: dict) -> dict:
    from swarm.compute.numclass import numerics_class

    return {
        "machine": platform.machine(),
        "numerics_class": numerics_class(),
        "ggml_features": _features(),
        "qemu_cpu": os.environ.get("QEMU_CPU", ""),
        "ggml_python": importlib.metadata.version("ggml_python"),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "torch_loaded": "torch" in sys.modules,
        **extra,
    }


def _node_product(w: object, x: np.ndarray) -> np.ndarray:
    """x [n, D] times w through a one-product graph, as a node's dense call runs: [n, rows]."""
    from swarm.compute.graph import Graph

    n = int(x.shape[0])
    gr = Graph(4, keep=False)
    try:
        gr.output(gr.mul_mat(gr.weight(w), gr.input(D, n)))
        out = np.empty((n, w.rows), np.float32)
        gr.build().run([np.ascontiguousarray(x)], [out])
        return out
    finally:
        gr.free()


def _stack(name: str, inputs: dict[str, np.ndarray]) -> object:
    """The type's E experts as one stack each of gate, up and down, as a node on a whole GGUF holds them."""
    from gguf import GGMLQuantizationType

    from swarm.compute import ffn, weights

    q = int(GGMLQuantizationType[name])

    def stacked(part: str, rows: int, cols: int) -> object:
        w = weights.Weight.of_bytes(inputs[f"{name}/{part}"], q, (E * rows, cols))
        return weights.repacked(weights.Weight(q, rows, cols, w.ptr, w.nbytes, w.keep, E))

    return ffn.ExpertStack(down=stacked("down", D, F), gate=stacked("gate", F, D), up=stacked("up", F, D))


def _moe(stack: object, x: np.ndarray, first: int) -> np.ndarray:
    """Rows x [n, D], which are rows first.. of the 8: row i goes to expert i % E (alone or in a batch)."""
    from swarm.compute import ffn

    n = int(x.shape[0])
    ids = (np.arange(first, first + n, dtype=np.int32) % E).reshape(n, 1)
    out = np.empty((n, 1, D), np.float32)
    ffn.moe_rows(stack, ids, np.ascontiguousarray(x), out)  # type: ignore[arg-type]
    return out.reshape(n, D)


def _kernels(
    raw: np.ndarray, q: int, node_w: object, stack: object
) -> dict[str, Callable[[np.ndarray, int], np.ndarray]]:
    """kernel -> (rows, index of the first) -> products."""
    from swarm.compute import probes

    return {
        "batch": lambda rows, _first: probes.product(raw, q, DENSE_OUT, rows),
        "node": lambda rows, _first: _node_product(node_w, rows),
        "stack": lambda rows, first: _moe(stack, rows, first),
    }


def record(inputs_path: Path, out: Path) -> None:
    from gguf import GGMLQuantizationType

    from swarm.compute import ggml, probes, weights

    ggml.set_threads(1)  # the same chunking on every machine (and even chunks: the 2-row kernels run)
    with np.load(inputs_path) as z:
        inputs = {k: z[k] for k in z.files}
    x = inputs["x"]
    arrays: dict[str, np.ndarray] = {}
    verdicts, repacked, skipped = {}, {}, []
    for name in TYPES:
        q = int(GGMLQuantizationType[name])
        if not probes.has_kernel(q):
            skipped.append(name)
            continue
        raw = inputs[f"{name}/dense"]
        node_w = weights.repacked(weights.Weight.of_bytes(raw, q, (DENSE_OUT, D)))
        stack = _stack(name, inputs)
        verdicts[name] = probes.rows_independent(q)
        repacked[name] = {"dense": node_w.repack is not None, "stack": stack.gate.repack is not None}
        for kernel, run in _kernels(raw, q, node_w, stack).items():
            arrays[f"{name}/{kernel}/alone"] = np.concatenate([run(x[i : i + 1], i) for i in range(N)])
            for n in COUNTS:
                arrays[f"{name}/{kernel}/{n}"] = run(x[:n], 0)
    meta = _meta({"rows_independent": verdicts, "repacked": repacked, "no_kernel": skipped})
    np.savez_compressed(out, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    print(f"{out}: {meta['numerics_class']}; rows independent {verdicts}")


def probe(out: Path, types: list[str]) -> None:
    """The probe's own products, (batched, alone) per type, and its live verdict on this build."""
    from gguf import GGMLQuantizationType

    from swarm.compute import probes

    arrays: dict[str, np.ndarray] = {}
    verdicts = {}
    for name in types:
        q = int(GGMLQuantizationType[name])
        batched, alone = probes.probe_products(q)
        arrays[f"{name}/alone"] = alone
        for n, y in batched.items():
            arrays[f"{name}/{n}"] = y
        verdicts[name] = probes.rows_independent(q)
    meta = _meta({"rows_independent": verdicts, "probe_rows": list(probes.PROBE_ROWS),
                  "probe_shape": list(probes.PROBE_SHAPE)})  # fmt: skip
    np.savez_compressed(out, meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)
    print(f"{out}: {out.stat().st_size} bytes; {meta['numerics_class']}; rows independent {verdicts}")


def load(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of a file `record` or `probe` wrote."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads(str(arrays.pop("meta"))), arrays


def main(argv: list[str]) -> int:
    if argv[:1] == ["inputs"] and len(argv) == 2:
        make_inputs(Path(argv[1]))
    elif argv[:1] == ["record"] and len(argv) == 3:
        record(Path(argv[1]), Path(argv[2]))
    elif argv[:1] == ["probe"] and len(argv) >= 2:
        probe(Path(argv[1]), argv[2:] or list(PROBE_TYPES))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
