"""The memory limit this process runs under, read from its control group (Linux; None anywhere else).

A phone's or a container's memory limit is often not the machine's RAM: Android and systemd put apps and
services in memory cgroups, docker/podman `--memory` does the same. A process past its cgroup's limit is
reclaimed first and then killed, so what it keeps resident must be sized to the limit, not to the RAM.

Both cgroup versions: v1's `memory.limit_in_bytes` in the process's own group of the memory hierarchy, v2's
`memory.max` in its group of the unified one; the group's directory is found through /proc/self/cgroup and
/proc/self/mountinfo (the mount's root may be a sub-group, as inside a container), and the limit is the
smallest along the path from the group up to the mount (a parent's limit binds its children too). What the
group holds now is split as the kernel charges it: anonymous memory (processes' own, never reclaimed without
swap) and page cache (file pages, such as memory-mapped slabs, reclaimed under pressure).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# v1 reports "no limit" as the largest page-aligned counter (9223372036854771712 on 4 KiB pages): any limit
# at or above this is none.
NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class MemoryCap:
    """A memory cgroup's limit and what it holds now (bytes)."""

    limit: int
    version: int  # 1 or 2
    path: Path  # the group whose limit binds (the process's own group or an ancestor)
    anon: int  # anonymous memory charged to that group now (its processes' own, its sub-groups' included)
    cache: int  # page cache charged to it now: file pages, reclaimed under pressure
    usage: int  # everything charged to it now

    def describe(self) -> str:
        what = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        return f"cgroup v{self.version} {what} {self.limit / 2**20:,.0f} MiB ({self.path})"


@dataclass(frozen=True)
class _Mount:
    version: int
    root: str  # the group mounted at `point` (the hierarchy's "/" unless a namespace or bind mount cut it)
    point: Path


def memory_cap(proc: Path = Path("/proc/self")) -> MemoryCap | None:
    """The tightest memory limit over this process's cgroups, v1 and v2 (None: no limit, or not Linux).
    `proc`: the /proc directory of the process to look at."""
    try:
        groups = _own_groups((proc / "cgroup").read_text())
        mounts = _memory_mounts((proc / "mountinfo").read_text())
    except OSError:
        return None
    caps = [cap for m in mounts if (cap := _cap_of(m, groups.get(m.version))) is not None]
    return min(caps, key=lambda c: c.limit) if caps else None


def _own_groups(text: str) -> dict[int, str]:
    """{1: the process's group in the v1 memory hierarchy, 2: its group in the unified one}, those present."""
    groups: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            groups[2] = path
        elif "memory" in controllers.split(","):
            groups[1] = path
    return groups


def _memory_mounts(text: str) -> list[_Mount]:
    """The mounts of the v1 memory hierarchy and of the v2 unified one (mountinfo: proc(5))."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        fstype, options = rest[0], rest[2].split(",")
        root, point = _unescape(fields[3]), Path(_unescape(fields[4]))
        if fstype == "cgroup" and "memory" in options:
            mounts.append(_Mount(1, root, point))
        elif fstype == "cgroup2":
            mounts.append(_Mount(2, root, point))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, ch)
    return field


def _cap_of(mount: _Mount, group: str | None) -> MemoryCap | None:
    """The tightest limit from the process's group in this mount up to the mount's root; None if none."""
    if group is None:
        return None
    own = _group_dir(mount, group)
    limit_file = "memory.limit_in_bytes" if mount.version == 1 else "memory.max"
    best: tuple[int, Path] | None = None
    for d in _up_to(own, mount.point):
        limit = _read_limit(d / limit_file)
        if limit is not None and (best is None or limit < best[0]):
            best = (limit, d)
    if best is None:
        return None
    limit, binding = best
    anon, cache = _held(binding, mount.version)  # the binding group's: its other members count against it too
    usage = _read_int(binding / ("memory.usage_in_bytes" if mount.version == 1 else "memory.current"))
    return MemoryCap(limit, mount.version, binding, anon, cache, usage if usage is not None else anon + cache)


def _group_dir(mount: _Mount, group: str) -> Path:
    """Where the group lies under the mount; the mount point itself when the group is outside what is
    mounted (a cgroup namespace whose paths the mount does not show)."""
    root = mount.root.rstrip("/")
    if group == root or group.startswith(root + "/"):
        d = mount.point / group[len(root) :].lstrip("/")
        if d.is_dir():
            return d
    return mount.point


def _up_to(d: Path, top: Path) -> Iterator[Path]:
    """d, its parent, ... up to and including top."""
    while True:
        yield d
        if d == top or d.parent == d or top not in d.parents:
            return
        d = d.parent


def _read_limit(path: Path) -> int | None:
    """A limit file's value in bytes; None for no limit ("max", or v1's largest counter) or no file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < NO_LIMIT else None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _held(group: Path, version: int) -> tuple[int, int]:
    """(anonymous, page cache) bytes charged to the group now, its sub-groups included. Shared memory is
    page cache to the kernel but never reclaimed without swap, so it counts as anonymous here."""
    stat = _read_stat(group / "memory.stat")
    if version == 1:
        shmem = stat.get("total_shmem", stat.get("shmem", 0))
        anon = stat.get("total_rss", stat.get("rss", 0)) + shmem
        return anon, stat.get("total_cache", stat.get("cache", 0)) - shmem
    shmem = stat.get("shmem", 0)
    return stat.get("anon", 0) + shmem, stat.get("file", 0) - shmem


def _read_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    stat = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            stat[key] = int(value)
    return stat


def physical_memory() -> int:
    """This machine's RAM in bytes (0: unknown)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
