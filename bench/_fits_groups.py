"""The "devices" of bench/fits.py: cgroup v1 memory groups (with a blkio group beside each, for the bytes its
processes read from disk), the page cache dropped before a capped process maps a file, and the disk's own
direct-I/O random-read speed."""

from __future__ import annotations

import mmap
import os
import random
import time
import uuid
from pathlib import Path

MiB = 1 << 20
BLOCKS = (4096, 128 << 10, 1 << 20)  # the random reads whose speed the bench measures
MEMORY = Path("/sys/fs/cgroup/memory")
BLKIO = Path("/sys/fs/cgroup/blkio")
# How a capped process starts: `python -c JOIN PROCS...`, which puts itself in every group whose cgroup.procs
# is named before `--`, then runs the `swarm` CLI with the rest (or execs a program with `-- PROGRAM ARGS`).
JOIN = """
import os, sys
args = sys.argv[1:]
while args and args[0] not in ('--', '--swarm'):
    open(args.pop(0), 'w').write(str(os.getpid()))
how = args.pop(0)
if how == '--':
    os.execv(args[0], args)
from swarm.coordinator.cli import main
sys.exit(main(args))
"""


def check_groups() -> None:
    """SystemExit with what is missing when this machine cannot make the bench's memory groups."""
    if os.geteuid() != 0:
        raise SystemExit("bench/fits.py runs as root: it makes memory cgroups under /sys/fs/cgroup/memory")
    if not (MEMORY / "memory.limit_in_bytes").exists():
        raise SystemExit(
            "bench/fits.py needs the cgroup v1 memory controller at /sys/fs/cgroup/memory (page cache counts "
            "against a v1 group's limit): mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory"
        )


def _whole_disk(path: Path) -> str | None:
    """ "MAJOR:MINOR" of the disk the file lies on (the disk, not its partition: blkio rules name disks)."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not dev.exists():
        return None
    if (dev / "partition").exists():
        dev = dev.resolve().parent
    try:
        return (dev / "dev").read_text().strip()
    except OSError:
        return None


class Device:
    """One capped device: a memory group with a limit (None: no limit, only measured) and a blkio group that
    counts what its processes read from the disk `disk` lies on."""

    def __init__(self, limit: int | None, name: str, disk: Path | None = None) -> None:
        tag = f"swrig-fits-{name}-{uuid.uuid4().hex[:8]}"  # the rig's sweep finds a killed run's
        self.memory = MEMORY / tag
        self.memory.mkdir()
        self.limit = limit
        if limit is not None:
            (self.memory / "memory.limit_in_bytes").write_text(str(limit))
        self.blkio: Path | None = BLKIO / tag
        whole = _whole_disk(disk) if disk is not None else None
        try:
            self.blkio.mkdir()
            # v1 blkio counts a group's bytes only on a disk it has a throttle rule for: one that never binds
            if whole is not None:
                (self.blkio / "blkio.throttle.read_bps_device").write_text(f"{whole} {1 << 50}")
        except OSError:
            self.blkio = None  # no blkio hierarchy: the bytes read are not reported

    def procs(self) -> list[str]:
        """The cgroup.procs files a process joins to run on this device."""
        files = [str(self.memory / "cgroup.procs")]
        if self.blkio is not None:
            files.append(str(self.blkio / "cgroup.procs"))
        return files

    def peak(self) -> int:
        """The most memory charged to the group at once (anonymous and page cache)."""
        return int((self.memory / "memory.max_usage_in_bytes").read_text())

    def anon(self) -> int:
        """Anonymous memory charged to the group now (its processes' own: never evicted, there is no swap)."""
        stat = dict(line.split() for line in (self.memory / "memory.stat").read_text().splitlines())
        return int(stat.get("total_rss", 0)) + int(stat.get("total_shmem", 0))

    def oom_kills(self) -> int:
        for line in (self.memory / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def read_bytes(self) -> int | None:
        """Bytes the group's processes read from block devices (None: not known)."""
        if self.blkio is None or not (self.blkio / "blkio.throttle.read_bps_device").read_text().strip():
            return None
        total = 0
        for line in (self.blkio / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] == "Read":
                total += int(parts[2])
        return total

    def close(self) -> None:
        for d in (self.memory, self.blkio):
            if d is None:
                continue
            deadline = time.monotonic() + 30
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)  # a killed process leaves its group a moment after it is reaped


def drop_page_cache(*paths: Path) -> None:
    """Drop the files' clean pages from the page cache (those a live process maps stay). A v1 group is
    charged for a page by the first group that reads it: a file this bench wrote, or a capped run before
    read, would otherwise be resident for free."""
    os.sync()
    for p in paths:
        for f in [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def direct_read_speed(path: Path, block: int, seconds: float = 3.0) -> float:
    """Random reads of `block` bytes at block-aligned offsets of `path` with O_DIRECT (no page cache), one
    at a time (queue depth 1, as a page fault waits): bytes/s."""
    size = path.stat().st_size // block * block
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    rng = random.Random(5)
    done = 0
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            done += os.preadv(fd, [buf], rng.randrange(size // block) * block)
        return done / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        buf.close()


def read_ahead_kb(path: Path) -> int:
    """The read-ahead, KiB, of the block device a file lies on (what a page fault reads around its page);
    0: unknown."""
    st = os.stat(path)
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for q in (dev / "queue", dev.resolve().parent / "queue"):
        try:
            return int((q / "read_ahead_kb").read_text())
        except OSError:
            continue
    return 0
