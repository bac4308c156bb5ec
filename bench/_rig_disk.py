"""The model file as a capped device reads it: a copy on an ext4 image on a loop device with direct I/O to the
image (no page of it is cached a second time, outside the device's cap) and a chosen read-ahead, without
touching the read-ahead of the machine's own disk, which other processes share.

A page fault on a memory-mapped file reads the read-ahead window around the page (the kernel's mmap
"read-around"), so a capped llama.cpp reads per decode token what its faults touch times that window: a phone's
128 KiB (Linux's default) or this VM's disk's 8 MiB give very different figures, and a bench shows both.

The mount point is a fresh directory under /tmp named with the run's tag, so a sweep finds it; the image is
either in that directory (removed on close) or, given a `workdir`, kept there for the next run under a name
with the rig's prefix (made again when the file's size changed).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
SLACK = 128 << 20  # the file system's own blocks beside the file
PREFIX = "swrig"


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout.strip()


def lacks() -> list[str]:
    return [f"{t} (a loop image)" for t in ("losetup", "mkfs.ext4", "mount", "umount") if not shutil.which(t)]


class LoopImage:
    """One image attached and mounted by open(), detached and unmounted by close()."""

    def __init__(self, gguf: Path, read_ahead_kb: int, tag_prefix: str, workdir: Path | None) -> None:
        self.gguf = gguf
        self.read_ahead_kb = read_ahead_kb
        self.dir = Path(tempfile.mkdtemp(prefix=f"{tag_prefix}disk-{read_ahead_kb}k-"))
        if workdir is None:
            self.image = self.dir / "image.ext4"
        else:
            workdir.mkdir(parents=True, exist_ok=True)
            self.image = workdir / f"{PREFIX}-image-{read_ahead_kb}k-{gguf.stem}.ext4"
        self.mount = self.dir / "mnt"
        self.loop: str | None = None
        self.mounted = False

    def open(self) -> Path:
        missing = lacks()
        if missing:
            raise RuntimeError("a loop image needs " + ", ".join(missing))
        # the file system's own blocks grow with it (inode tables, a journal of up to 1 GiB): a 6 GB model did
        # not fit in its size plus SLACK alone
        size = self.gguf.stat().st_size + SLACK + self.gguf.stat().st_size // 16
        if not self.image.exists() or self.image.stat().st_size != size:
            self.image.unlink(missing_ok=True)
            with open(self.image, "wb") as f:
                f.truncate(size)
            _run("mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0", str(self.image))
        self.loop = _run("losetup", "--direct-io=on", "--show", "-f", str(self.image))
        name = Path(self.loop).name
        if Path(f"/sys/block/{name}/loop/dio").read_text().strip() != "1":
            log.warning("%s: no direct I/O to its backing file (its pages may be cached twice)", self.loop)
        Path(f"/sys/block/{name}/queue/read_ahead_kb").write_text(str(self.read_ahead_kb))
        self.mount.mkdir()
        _run("mount", "-o", "noatime", self.loop, str(self.mount))
        self.mounted = True
        copy = self.mount / self.gguf.name
        if not copy.exists() or copy.stat().st_size != self.gguf.stat().st_size:
            shutil.copyfile(self.gguf, copy)
            _run("sync", "-f", str(copy))
        return copy

    def close(self) -> list[str]:
        """Unmount, detach, remove the run's directory; what could not be undone."""
        errors = []
        if self.mounted:
            try:
                _run("umount", str(self.mount))
                self.mounted = False
            except RuntimeError as e:
                errors.append(str(e))
        if self.loop is not None and not self.mounted:
            try:
                _run("losetup", "-d", self.loop)
                self.loop = None
            except RuntimeError as e:
                errors.append(str(e))
        if not self.mounted:
            shutil.rmtree(self.dir, ignore_errors=True)
        return errors


def _mounts(tag_prefix: str) -> list[tuple[str, str]]:
    """(device, mount point) of every mount under a directory of the prefix."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        dev, point = line.split()[:2]
        if f"/{tag_prefix}" in point:
            found.append((dev, point))
    return found


def _loops(tag_prefix: str) -> list[tuple[str, str]]:
    """(loop device, backing file) of every loop device whose backing file's name has the prefix."""
    if not shutil.which("losetup"):
        return []
    out = subprocess.run(
        ["losetup", "-l", "-n", "-O", "NAME,BACK-FILE"], capture_output=True, text=True
    ).stdout
    rows = [line.split(None, 1) for line in out.splitlines() if line.strip()]
    return [(r[0], r[1].strip()) for r in rows if len(r) == 2 and f"/{tag_prefix}" in r[1]]


def leftovers(tag_prefix: str) -> list[str]:
    dirs = [str(d) for d in Path(tempfile.gettempdir()).glob(f"{tag_prefix}disk-*")]
    return (
        [f"mount {p}" for _, p in _mounts(tag_prefix)]
        + [f"loop {n} ({b})" for n, b in _loops(tag_prefix)]
        + dirs
    )


def sweep(tag_prefix: str) -> None:
    """Unmount the prefix's mounts and detach their loop devices and any loop device on an image of the
    prefix, then remove the run directories (a kept image in a workdir stays: it is a file, not a mount)."""
    for dev, point in _mounts(tag_prefix):
        subprocess.run(["umount", "-l", point], capture_output=True)
        if dev.startswith("/dev/loop"):
            subprocess.run(["losetup", "-d", dev], capture_output=True)
    for dev, _ in _loops(tag_prefix):
        subprocess.run(["losetup", "-d", dev], capture_output=True)
    for d in Path(tempfile.gettempdir()).glob(f"{tag_prefix}disk-*"):
        if not any(p.startswith(str(d)) for _, p in _mounts(tag_prefix)):
            with contextlib.suppress(OSError):
                shutil.rmtree(d)
