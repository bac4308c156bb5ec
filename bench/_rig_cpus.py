"""Cores reserved for a rig's devices (Rig.reserve): every other process of the machine, those in the root
cpuset now and what they start meanwhile (a child inherits its parent's group), waits on the other cores in a
group of its own until the rig closes, then goes back. The sweep moves them back too: that group's processes
are the machine's own, never killed. cgroup v1's cpuset controller; a core must be left for the rest."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

REST = "rest"  # the last part of that group's name


def reserve(group: Path, cpus: str) -> str:
    """Make `group` (a child of the cpuset root) hold every other process on the cores that `cpus` leaves; why
    it cannot ("" when done)."""
    root = group.parent
    rest = sorted(_cpus((root / "cpuset.cpus").read_text()) - _cpus(cpus))
    if not rest:
        return f"reserving cores {cpus} leaves none for the machine's other processes"
    group.mkdir()
    (group / "cpuset.mems").write_text((root / "cpuset.mems").read_text().strip())
    (group / "cpuset.cpus").write_text(",".join(str(c) for c in rest))
    for pid in _pids(root):
        with contextlib.suppress(OSError):  # kernel threads bound to a core stay where they are
            (group / "cgroup.procs").write_text(str(pid))
    return ""


def _cpus(text: str) -> set[int]:
    """A cpuset list ("0-3,6") as its cores."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            out.update(range(int(first), int(last or first) + 1))
    return out


def release(group: Path, timeout: float = 10.0) -> None:
    """Move every process of a REST group back to the root cpuset, then remove the group (processes started
    meanwhile are moved too: they inherited the group)."""
    root = group.parent
    empty_and_remove(group, lambda pid: (root / "cgroup.procs").write_text(str(pid)), timeout)


def empty_and_remove(group: Path, each: Callable[[int], object], timeout: float = 10.0) -> None:
    """`each(pid)` for every process of the group (one that ended meanwhile is passed over) until the group can
    be removed, then remove it: a process leaves its group a moment after it is moved or killed."""
    deadline = time.monotonic() + timeout
    while group.exists():
        for pid in _pids(group):
            with contextlib.suppress(OSError):
                each(pid)
        try:
            group.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def release_leftovers(root: Path, tag_prefix: str) -> None:
    """Release the REST groups a killed rig left under the cpuset root `root`."""
    for group in sorted(g for g in root.glob(f"{tag_prefix}*") if g.name.endswith(f"-{REST}")):
        with contextlib.suppress(OSError):
            release(group)


def _pids(group: Path) -> list[int]:
    try:
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []
