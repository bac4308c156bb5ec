"""How a coordinator's or a node's C heap gives freed memory back, decided once at start (glibc on Linux only).

A forward pass allocates and frees its activations, a node's call its rows: torch's CPU tensors and numpy's
arrays come from malloc. glibc's defaults hand big freed blocks back to the kernel (blocks over its adaptive
mmap threshold are unmapped; a heap top over the trim threshold is cut), so the next pass of the same size
maps them afresh and faults every page in again, tens of thousands of minor faults per prompt pass. With
blocks of up to MMAP_THRESHOLD taken from the heap and up to TRIM_THRESHOLD of a freed heap top kept, a pass
finds the memory the pass before it freed: later passes fault a few times and run a few percent faster, on
the coordinator and on the nodes alike. Resident memory then stays at the largest pass's high-water mark
instead of falling back between passes; the peak is the same.

A user's own GLIBC_TUNABLES malloc settings win.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): bigger blocks are always mapped
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Make this process's heap keep what a pass frees for the next one; whether it was set."""
    if not sys.platform.startswith("linux") or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:  # the process's own symbols, libc's among them (find_library would start ldconfig at every start)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # a libc without mallopt
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.debug("mallopt refused the heap policy; glibc's defaults stay")
    return done
