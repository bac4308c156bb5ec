"""Python's garbage collector in a long-running process: what start-up built is not scanned again.

A node or a coordinator builds hundreds of thousands of objects while it starts (the GGUF reader's
fields, slab tables, model modules, kept graphs) and keeps them for its whole life. Python's
collector of the oldest generation walks every one of them each time it runs: a stall of every call in
flight, the longer the more the process holds. Moved to the permanent
generation once start-up is over (`gc.freeze`), they are never walked again; objects made afterwards
are collected as before.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup() -> None:
    """Collect start-up's garbage, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()
    log.debug("%d start-up objects exempt from garbage collection", gc.get_freeze_count())
