"""The model file under a smaller read-ahead, for bench/fits.py: the rig's loop image (bench/_rig_disk.py) kept
in the bench's workdir between runs, mounted only while the block runs. Its mount and loop device carry the
rig's prefix, so `python bench/_rig.py --sweep` removes them after a killed run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from _rig_disk import PREFIX, LoopImage


@contextlib.contextmanager
def readahead_copy(gguf: Path, workdir: Path, read_ahead_kb: int) -> Iterator[Path]:
    """A copy of `gguf` on a loop device with `read_ahead_kb` of read-ahead, while the block runs."""
    image = LoopImage(gguf, read_ahead_kb, f"{PREFIX}-fits-", workdir)
    try:
        yield image.open()
    finally:
        errors = image.close()
        if errors:
            raise RuntimeError("; ".join(errors))
