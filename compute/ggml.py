"""ggml itself: the library loaded on first use, its log routed into ours, and the thread budget every graph of
this process runs on.

ggml is taken through ggml-python (its package builds ggml from source, with the build's SIMD level: AVX2,
AVX-512, NEON). One process runs one ggml graph at a time on its thread budget (`set_threads`). In a process
that has torch (a coordinator), ggml's OpenMP threads are torch's (the one libgomp in the process) and the
budget is torch's too, so the two pools never fight over the cores; a node never loads torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

from gguf import GGMLQuantizationType

log = logging.getLogger(__name__)

F32 = int(GGMLQuantizationType.F32)

# ggml is loaded on first use: `import ggml` loads the shared libraries, which a process that never
# multiplies (swarm inspect, shard) should not pay for.
_ggml = None
_load_lock = threading.Lock()
compute_lock = threading.Lock()  # one graph at a time per process: one thread budget
_threads = 0  # 0: the default (`default_threads`)


def ggml_lib():  # noqa: ANN201 - the ggml-python module
    global _ggml
    if _ggml is None:
        with _load_lock:
            if _ggml is None:
                import ggml

                ggml.ggml_cpu_init()
                _callbacks.append(ggml.ggml_log_callback(_ggml_log))  # kept alive while ggml may call it
                ggml.ggml_log_set(_callbacks[-1], None)
                if ggml.ggml_cpu_has_avx512():
                    log.warning(AVX512_WARNING)
                elif ggml.ggml_cpu_has_avx2() and not ggml.ggml_cpu_has_llamafile():
                    log.warning(NO_TINYBLAS_WARNING)
                _ggml = ggml
    return _ggml


def _ggml_log(level: int, text: bytes | None, _user: object) -> None:
    """ggml's own messages (a tensor repacked, a buffer allocated) into this module's log: debug-level news
    stays out of a user's terminal, warnings and errors do not."""
    msg = (text or b"").decode(errors="replace").rstrip()
    if msg:
        log.log(logging.WARNING if level >= 3 else logging.DEBUG, "ggml: %s", msg)  # 3: GGML_LOG_LEVEL_WARN


_callbacks: list[object] = []


# ggml built for an AVX-512 CPU takes AVX-512 code paths in some quantized dot products whose float sums round
# differently from the AVX2 ones: the same slab gives other bits than on an AVX2 node (an audit would then ban
# an honest node) and strays from llama.cpp's own kernels (which take the AVX2 paths for these types on both).
# On x86, ggml is built for the AVX2 baseline (README: the install command's CMAKE_ARGS).
GGML_CMAKE_ARGS = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_LLAMAFILE=ON"
AVX512_WARNING = (
    "ggml was built with AVX-512 kernels: its results differ in the last bits from AVX2 machines' and from "
    f'llama.cpp\'s; reinstall ggml-python with CMAKE_ARGS="{GGML_CMAKE_ARGS}" (see the README)'
)
NO_TINYBLAS_WARNING = (
    "ggml was built without llamafile's tinyBLAS: prompts are read up to 1.8x slower on Q8_0 weights; reinstall "
    f'ggml-python with CMAKE_ARGS="{GGML_CMAKE_ARGS}" (see the README)'
)


def set_threads(n: int) -> None:
    """Threads for every ggml graph of this process (and torch's, the same OpenMP pool, where it is loaded)."""
    global _threads
    if n < 1:
        raise ValueError(f"thread count must be at least 1, got {n}")
    _threads = n
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)


def threads() -> int:
    return getattr(_here, "threads", 0) or _threads or default_threads()


def default_threads() -> int:
    """torch's thread count where torch is loaded (the pool ggml shares), else one per core this process may
    run on."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return int(torch.get_num_threads())
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


_here = threading.local()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """ggml graphs run on one thread in this block, on this thread only (work off the critical path, e.g.
    audits, takes one core rather than the model's whole team)."""
    saved = getattr(_here, "threads", 0)
    _here.threads = 1
    try:
        yield
    finally:
        _here.threads = saved


