"""What a node's venv in the arm64 root has, for deploy/arm/arm-root.sh (runs inside the root, any build).

    python check.py

Prints the machine, the ggml features that pick kernels, whether torch is installed and whether loading
the node's server imported it, the numerics class, and which quant types' rows keep their bits in a batch
(swarm.compute.probes). A part that fails to import is reported, not raised: the report is the point.
"""

from __future__ import annotations

import importlib.util
import platform
import sys

FEATURES = ("neon", "arm_fma", "dotprod", "matmul_int8", "sve", "llamafile")
TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "F16", "F32")


def main() -> int:
    import ggml

    ggml.ggml_cpu_init()  # ggml reads the CPU's features (on ARM: the auxiliary vector) here
    print(f"machine {platform.machine()}, Python {platform.python_version()}")
    feats = {
        f: int(getattr(ggml, f"ggml_cpu_has_{f}")()) for f in FEATURES if hasattr(ggml, f"ggml_cpu_has_{f}")
    }
    print("ggml:", ", ".join(f"{k}={v}" for k, v in feats.items()))
    print("torch installed:", importlib.util.find_spec("torch") is not None)
    ok = True
    try:
        import swarm.node.server  # noqa: F401 - what `swarm node` loads to serve

        print("node server loads; torch imported:", "torch" in sys.modules)
    except ImportError as e:
        print(f"node server does not load: {e}")
        ok = False
    try:
        from gguf import GGMLQuantizationType

        from swarm.compute.numclass import numerics_class
        from swarm.compute.probes import rows_independent

        print("numerics class:", numerics_class())
        verdicts = {t: rows_independent(int(GGMLQuantizationType[t])) for t in TYPES}
        print(
            "rows keep their bits in a batch:",
            ", ".join(f"{t}={'yes' if v else 'NO'}" for t, v in verdicts.items()),
        )
    except ImportError as e:
        print(f"compute probes do not load: {e}")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
