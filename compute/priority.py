"""Background threads at the idle scheduling priority: they run in the time the foreground work leaves free
rather than taking time slices from it (the coordinator's audits, a node's check of its own slab files)."""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def idle_priority() -> bool:
    """Put the calling thread at the idle scheduling priority; whether it got one that yields to every other
    thread (Linux: SCHED_IDLE, else nice 19, both per thread there). Elsewhere nothing is changed: macOS'
    nice would slow the whole process, its foreground threads included."""
    name = threading.current_thread().name
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return True
        except OSError as e:  # a sandbox may forbid it
            log.debug("no SCHED_IDLE for thread %s (%s); trying nice", name, e)
    if sys.platform.startswith("linux"):
        try:
            os.nice(19)  # clamped at 19
            return True
        except OSError as e:
            log.debug("no nice for thread %s either (%s)", name, e)
    return False
