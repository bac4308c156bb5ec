"""The numerics class of this process's ggml build: what decides the bits its kernels compute.

Two builds of the same ggml version with the same class sum every product in the same order, so their answers
for the same slab and rows are equal bit for bit; builds of different classes sum in other orders (ARM's NEON,
dot-product and int8-matmul kernels, x86's AVX2 and AVX-512 paths) and differ by a few units in the last
place. The class is: the CPU architecture, the CPU features ggml reports that select other kernels, and the
ggml version. A node reports it (Info, mDNS), `swarm status` shows it, and the coordinator's audits compare a
node of its own class bit for bit and one of another class within the bound of swarm.coordinator.checks.tolerance.

ggml's x86 feature flags say what the build was compiled for (this project builds the AVX2 baseline, see the
README); its ARM flags say what the build uses on this CPU (compiled for and present at run time).
"""

from __future__ import annotations

import functools
import platform
from importlib import metadata

# ggml_cpu_has_* flags that choose other kernels (other summation orders), by architecture. F16C, FMA and
# the like change no order where AVX2 is in; what is left out here does not pick a kernel of its own.
_FEATURES = {
    "x86_64": ("avx", "avx2", "avx_vnni", "avx512", "avx512_vbmi", "avx512_vnni", "avx512_bf16", "amx_int8"),
    "aarch64": ("neon", "fp16_va", "dotprod", "matmul_int8", "sve", "sme"),  # fp16_va: F16 sums in F16
}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def _ggml_version() -> str:
    try:
        return "ggml-python " + metadata.version("ggml-python")
    except metadata.PackageNotFoundError:  # a build from a source tree
        return "ggml-python ?"


@functools.cache
def numerics_class() -> str:
    """This process's class, e.g. 'x86_64 avx+avx2 / ggml-python 0.0.45' or 'aarch64 neon+dotprod / ...'."""
    from swarm.compute.ggml import ggml_lib

    g = ggml_lib()
    flags = {}
    for name in (*_FEATURES["x86_64"], *_FEATURES["aarch64"]):
        has = getattr(g, f"ggml_cpu_has_{name}", None)
        flags[name] = bool(has()) if has is not None else False
    sve_cnt = int(g.ggml_cpu_get_sve_cnt()) if hasattr(g, "ggml_cpu_get_sve_cnt") else 0
    return class_of(platform.machine(), flags, _ggml_version(), sve_cnt)


def class_of(machine: str, flags: dict[str, bool], ggml: str, sve_cnt: int = 0) -> str:
    """The class of a build on `machine` whose ggml_cpu_has_* flags are `flags` (name -> bool)."""
    machine = _ALIASES.get(machine.lower(), machine.lower())
    features = [name for name in _FEATURES.get(machine, ()) if flags.get(name)]
    if "sve" in features and sve_cnt:
        features[features.index("sve")] = f"sve{8 * sve_cnt}"  # the vector length decides the sums
    return f"{machine} {'+'.join(features) or 'generic'} / {ggml}"


def same_class(a: str, b: str) -> bool:
    """Whether answers of these two classes are equal bit for bit (an unknown class, '', is never)."""
    return bool(a) and a == b
