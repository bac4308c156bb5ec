"""The model file under a smaller read-ahead, for bench/fits.py: a copy on an ext4 file system in a loop
device (direct I/O to its backing file, so no page is cached twice) whose read_ahead_kb is set, without
touching the read-ahead of the machine's own disk, which other processes share.

A page fault on a memory-mapped file reads the read-ahead window around the page (the kernel's mmap
"read-around"), so a capped llama.cpp reads per decode token what its faults touch times that window: 8 MiB
on this VM's disk, 128 KiB (Linux's default, and common on phones) here.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)
SLACK = 128 << 20  # the file system's own blocks beside the file


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip()


@contextlib.contextmanager
def readahead_copy(gguf: Path, workdir: Path, read_ahead_kb: int) -> Iterator[Path]:
    """A copy of `gguf` on a loop device with `read_ahead_kb` of read-ahead, while the block runs (the image
    stays in `workdir` for the next run; the copy is made again when the file's size changed)."""
    image = workdir / f"readahead-{read_ahead_kb}k.img"
    mount = workdir / f"readahead-{read_ahead_kb}k"
    size = gguf.stat().st_size + SLACK
    fresh = not image.exists() or image.stat().st_size != size
    if fresh:
        image.unlink(missing_ok=True)
        with open(image, "wb") as f:
            f.truncate(size)
        _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(image))
    loop = _run("losetup", "--direct-io=on", "--show", "-f", str(image))
    name = Path(loop).name
    try:
        dio = Path(f"/sys/block/{name}/loop/dio").read_text().strip()
        if dio != "1":
            log.warning("%s: no direct I/O to its backing file (pages may be cached twice)", loop)
        Path(f"/sys/block/{name}/queue/read_ahead_kb").write_text(str(read_ahead_kb))
        mount.mkdir(exist_ok=True)
        _run("mount", "-o", "noatime", loop, str(mount))
        try:
            copy = mount / gguf.name
            if not copy.exists() or copy.stat().st_size != gguf.stat().st_size:
                shutil.copyfile(gguf, copy)
                _run("sync", "-f", str(copy))
            yield copy
        finally:
            _run("umount", str(mount))
    finally:
        _run("losetup", "-d", loop)
