"""Map the pages of memory-mapped weights in ahead of use, in the background.

Weights are multiplied where they lie in their file's memory map, so the first use of each 4 KiB page costs
a page fault: a cold `swarm run` would pay a fault per page of every expert it meets for the first time,
tens of milliseconds a token early on. llama.cpp maps its file with MAP_POPULATE for the same reason. Here
the byte ranges a process will use (the dense tensors and the expert slabs it holds, not the whole file:
a node holding a quarter of a GGUF keeps a quarter of it resident) are populated with
madvise(MADV_POPULATE_READ) on a background thread while the rest of the start-up runs; where the kernel
lacks it (before Linux 5.14) MADV_WILLNEED starts the reads instead. Anywhere else this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading
from collections.abc import Iterable

import numpy as np

log = logging.getLogger(__name__)

MADV_WILLNEED = 3
MADV_POPULATE_READ = 22  # Linux 5.14+
PAGE = mmap.PAGESIZE

_libc = None


def _madvise() -> object | None:
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name, use_errno=True) if name else False
        except OSError:
            _libc = False
    if not _libc or not hasattr(_libc, "madvise"):
        return None
    fn = _libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def page_ranges(arrays: Iterable[np.ndarray]) -> list[tuple[int, int]]:
    """The page-aligned [start, end) address ranges the arrays' bytes cover, merged and sorted."""
    spans = sorted(
        (a.ctypes.data // PAGE * PAGE, -(-(a.ctypes.data + a.nbytes) // PAGE) * PAGE)
        for a in arrays
        if a.nbytes
    )
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def populate(arrays: Iterable[np.ndarray], background: bool = True) -> threading.Thread | None:
    """Fault the pages of these (memory-mapped) arrays in; on a daemon thread unless `background` is off.

    The arrays must stay alive until it is done (the views a model holds do). Returns the thread.
    """
    fn = _madvise()
    if fn is None:
        return None
    ranges = page_ranges(arrays)

    def run() -> None:
        total = 0
        for start, end in ranges:
            if fn(start, end - start, MADV_POPULATE_READ) != 0:
                fn(start, end - start, MADV_WILLNEED)  # older kernel: at least start the reads
            total += end - start
        log.debug("populated %d ranges, %.1f MiB", len(ranges), total / 2**20)

    if not background:
        run()
        return None
    t = threading.Thread(target=run, name="swarm-populate", daemon=True)
    t.start()
    return t


MADV_DONTNEED = 4


def file_mapped(arr: np.ndarray) -> bool:
    """Whether the array's bytes are a view of a memory-mapped file (np.memmap or mmap.mmap somewhere under it)."""
    base: object = arr
    while base is not None:
        if isinstance(base, np.memmap | mmap.mmap):
            return True
        base = getattr(base, "base", None) if isinstance(base, np.ndarray) else getattr(base, "obj", None)
    return False


def release(owner: np.ndarray, ptr: int, nbytes: int) -> None:
    """Drop this process's mapping of the pages under [ptr, ptr + nbytes) of `owner`, a file-mapped array (a
    GGUF or slab whose bytes were copied elsewhere, repacked): the resident memory falls by them, and a later
    read maps them in again from the page cache, so nothing is lost. Pages at the edges go too (they come
    back on their next use). Not for memory of the process's own (madvise would zero it): an owner that is
    not file-mapped is left alone, as everything is where madvise is missing."""
    fn = _madvise()
    if fn is None or nbytes <= 0 or not file_mapped(owner):
        return
    start = ptr // PAGE * PAGE
    end = -(-(ptr + nbytes) // PAGE) * PAGE
    fn(start, end - start, MADV_DONTNEED)
