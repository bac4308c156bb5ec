"""A node's check of its own slab files: a slab whose file no longer matches the manifest (bit rot, a failing
disk, a stray write) stops being served before it shapes an answer, on an honest device, with no coordinator
needed to notice.

Two watches over the slab files of a shard directory, each on a thread of its own:
- stat, at the node's own priority: every WATCH_SECONDS each file's (size, mtime, ctime, inode, device),
  nothing read; a file whose stat changed is hashed against the manifest at once (paced to
  SHARE_WITHOUT_IDLE of a core). A changed file is an event, and the node may be serving its bytes: it is
  checked now even on a machine whose cores are all busy. Stat costs a few microseconds a file, so a node of
  10,000 slabs stats less often: never more than WATCH_SHARE of a core.
- rounds, at the idle scheduling priority (Linux SCHED_IDLE: in the time the node's calls and everything
  else on the device leave free; its reads get the idle I/O class where the block scheduler has one): every
  `interval` seconds (a full pass, then that pause) every file it serves is hashed against the manifest,
  READ_CHUNK bytes at a time: what a stat cannot see, bytes that rot on the medium or a write through a
  memory map. The rounds thread only hashes; what it finds goes to the stat thread, which alone keeps the
  state and calls back (so an idle-priority thread that the machine leaves without a core never holds
  anything the node waits for). A round's verdict on a file whose stat changed since it was read is
  dropped: the stat watch hashes the file as it is now.

A slab whose file fails (missing, unreadable, another size, a SHA-256 that differs) goes to `on_failed`,
once: the node stops serving it, announcing it and giving its file out (swarm.node.daemon). That holds for a
slab multiplied where it lies in the file's memory map, whose answers the damage reaches at once, and as much
for one copied into ggml's repacked layout at start-up, whose answers it does not reach: the file is what the
node vouches for (others fetch it, and the node copies it again after its memory budget evicted the copy).
A dropped slab's file is still watched by stat: once it matches the manifest again (restored from a good
copy, or fetched again) `on_restored` takes it back.

Shard directories only: a whole GGUF has no per-slab hashes to check against (the coordinator's audits are
what checks a node on one), and a node started with --no-verify vouches for nothing.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from swarm.compute.priority import idle_priority

if TYPE_CHECKING:  # `swarm node`'s parser reads this module's defaults: it imports nothing heavy at the top
    from swarm.sharding.manifest import SlabEntry
    from swarm.sharding.slabs import SlabKey

log = logging.getLogger(__name__)

# Seconds between full rounds: a round over 20 GB of slabs is ~25 s of one core (SHA-256 at 830 MiB/s on a
# shared Xeon), at idle priority, once an hour.
DEFAULT_INTERVAL = 3600.0
WATCH_SECONDS = 2.0  # how often every file is stat'ed
WATCH_SHARE = 0.01  # at most this share of a core on stat'ing (it sets the pace for very many files)
READ_CHUNK = 1 << 20  # bytes hashed per read: small enough to yield often, large enough to cost little
# Where the thread could not get an idle priority (macOS, a sandbox), hashing keeps to this share of a core.
SHARE_WITHOUT_IDLE = 0.25
# A file changed less than this before the node's start-up check began may have changed after that check read
# it (timestamps are as coarse as 2 s on some filesystems): it is hashed again once the watch starts.
CLOCK_SLACK_NS = 2_000_000_000


class FileStat(NamedTuple):
    """What a stat tells of a file without reading it; another value: the file was written or replaced."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int


def file_stat(path: Path) -> FileStat | None:
    """The file's FileStat; None when it cannot be stat'ed (gone, or a directory above it unreadable)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStat(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _forget_pages(path: Path) -> None:
    """Let the page cache drop what the check read of this file: a round reads every slab byte, and without
    this it would pull the files of repacked slabs (whose pages the node released at start-up) back into
    memory, pushing out pages the device needs. Pages the node has mapped stay: the kernel keeps mapped pages.
    Only advice: where it is missing or refused nothing changes."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        log.debug("%s: posix_fadvise: %s", path, e)
    finally:
        os.close(fd)


class _Stopped(Exception):
    """The check was asked to stop in the middle of a file."""


class _Pace:
    """Called between the pieces of a file: ends the hashing when the check stops, and where the thread has no
    idle priority sleeps so that hashing takes at most `share` of a core."""

    def __init__(self, stop: threading.Event, share: float | None) -> None:
        self.stop = stop
        self.share = share
        self._t = time.monotonic()

    def restart(self) -> None:
        self._t = time.monotonic()

    def __call__(self) -> None:
        if self.share is not None:
            busy = time.monotonic() - self._t
            self.stop.wait(busy * (1.0 / self.share - 1.0))
            self._t = time.monotonic()
        if self.stop.is_set():
            raise _Stopped


@dataclass
class _Watched:
    entry: SlabEntry
    stat: FileStat | None  # the file's stat when it was last hashed (None: it could not be stat'ed)
    round: int  # the round it was last hashed in


class _Verdict(NamedTuple):
    """What a round found of one file (entry None: the round `round` ended)."""

    entry: SlabEntry | None
    stat: FileStat | None
    bad: str | None
    round: int


class SlabSelfCheck:
    """The node's watch over its slab files (see the module docstring). `watch(entry)` adds a slab the node
    serves; `on_failed(entry, why)` is called (on the stat thread) when its file fails, and
    `on_restored(entry)` when a failed one matches the manifest again (it may raise OSError or ValueError:
    the slab then stays dropped, and its file is checked again at its next change). `idle=False`: rounds at
    the node's own priority, paced to SHARE_WITHOUT_IDLE of a core, as where no idle priority is to be had."""

    def __init__(
        self,
        directory: str | Path,
        interval: float,
        on_failed: Callable[[SlabEntry, str], None],
        on_restored: Callable[[SlabEntry], None],
        watch_seconds: float = WATCH_SECONDS,
        chunk: int = READ_CHUNK,
        idle: bool = True,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval {interval}: the pause between rounds must be positive")
        self.directory = Path(directory)
        self.interval = interval
        self.watch_seconds = watch_seconds
        self.chunk = chunk
        self.on_failed = on_failed
        self.on_restored = on_restored
        self.want_idle = idle
        self.rounds = 0  # full rounds ended
        self.sweeps = 0  # stat sweeps ended
        self.hashes: Counter[SlabKey] = Counter()  # files hashed, per slab
        self.idle: bool | None = None  # whether the rounds thread got an idle priority (None: not started yet)
        self.native_id: int | None = None  # the rounds thread's id as the OS knows it
        self._new: list[tuple[SlabEntry, int | None, bool]] = []  # from watch(), taken in by the stat thread
        self._served: dict[SlabKey, _Watched] = {}  # these two: the stat thread's alone
        self._dropped: dict[SlabKey, _Watched] = {}
        self._round = 0
        self._lock = threading.Lock()  # guards _new only
        self._stop = threading.Event()
        self._wake = threading.Event()  # a round's verdict is waiting for the stat thread
        self._todo: queue.SimpleQueue[tuple[int, list[SlabEntry]] | None] = queue.SimpleQueue()
        self._verdicts: queue.SimpleQueue[_Verdict] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="swarm-selfcheck", daemon=True)
        self._rounds_thread = threading.Thread(target=self._rounds, name="swarm-selfcheck-rounds", daemon=True)

    def watch(self, entry: SlabEntry, since_ns: int | None = None, failed: bool = False) -> None:
        """Watch this slab's file from now on (it verified against the manifest). `since_ns`: when the check
        it passed began (time.time_ns()), if that was not just now: a file changed after it is hashed again at
        once. `failed`: it failed its check and was dropped (on_failed is not called for it again); it is
        taken back once it matches."""
        with self._lock:
            self._new.append((entry, since_ns, failed))

    def start(self) -> SlabSelfCheck:
        self._rounds_thread.start()
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._todo.put(None)
        for t in (self._thread, self._rounds_thread):
            if t.is_alive():
                t.join(timeout)

    def _run(self) -> None:
        """The stat thread: sweeps, the verdicts of rounds, and when the next round starts."""
        pace = _Pace(self._stop, SHARE_WITHOUT_IDLE)
        next_round = time.monotonic() + self.interval  # every file was hashed just before the node served it
        next_watch = 0.0
        in_round = False
        try:
            while not self._stop.is_set():
                if self._take_verdicts():  # the round ended: the next one after the pause
                    in_round, next_round = False, time.monotonic() + self.interval
                now = time.monotonic()
                if now >= next_watch:
                    next_watch = now + self._sweep(pace)
                if not in_round and now >= next_round:
                    self._round += 1
                    self._todo.put((self._round, [w.entry for w in self._served.values()]))
                    in_round, next_round = True, float("inf")
                self._wake.wait(max(0.0, min(next_watch, next_round) - time.monotonic()))
                self._wake.clear()
        except _Stopped:
            pass
        except Exception:
            log.exception("the check of this node's slab files stopped; restart the node to check them again")

    def _take_verdicts(self) -> bool:
        """Apply what the rounds thread found; whether the round in progress ended."""
        ended = False
        while True:
            try:
                v = self._verdicts.get_nowait()
            except queue.Empty:
                return ended
            if v.entry is None:  # the round ended
                self.rounds += 1
                ended = True
                log.debug("round %d ended: %d slab files match, %d dropped", self.rounds, len(self._served),
                          len(self._dropped))  # fmt: skip
                continue
            key = (v.entry.layer, v.entry.expert)
            if key not in self._served and key not in self._dropped:
                continue  # no longer watched
            if file_stat(self._path(v.entry)) != v.stat:
                continue  # changed since the round read it: the stat watch hashes it as it is now
            self._apply(v.entry, v.stat, v.bad, v.round)

    def _rounds(self) -> None:
        """The rounds thread: hashes the files of each round it is given, at the idle priority."""
        self.native_id = threading.get_native_id()
        self.idle = idle_priority() if self.want_idle else False
        pace = _Pace(self._stop, None if self.idle else SHARE_WITHOUT_IDLE)
        try:
            while (task := self._todo.get()) is not None:
                number, entries = task
                for entry in entries:
                    stat, bad = self._hash(entry, pace)
                    self._verdicts.put(_Verdict(entry, stat, bad, number))
                    self._wake.set()
                self._verdicts.put(_Verdict(None, None, None, number))
                self._wake.set()
        except _Stopped:
            pass
        except Exception:
            log.exception("the rounds over this node's slab files stopped; restart the node to check them again")

    def _sweep(self, pace: _Pace) -> float:
        """Stat every watched file, then hash those that changed; the seconds until the next sweep."""
        t0 = time.monotonic()
        with self._lock:
            new, self._new = self._new, []
        changed: list[SlabEntry] = []
        for entry, since, failed in new:
            if failed:  # hashed once more at this sweep (no stat to compare with), then watched for a change
                self._dropped[(entry.layer, entry.expert)] = _Watched(entry, None, self._round)
                continue
            stat = file_stat(self._path(entry))
            if since is not None and (
                stat is None or max(stat.mtime_ns, stat.ctime_ns) >= since - CLOCK_SLACK_NS
            ):
                changed.append(entry)  # it may have changed after the start-up check read it
            else:
                self._served[(entry.layer, entry.expert)] = _Watched(entry, stat, self._round)
        for watched in (self._served, self._dropped):
            changed += [w.entry for w in watched.values() if file_stat(self._path(w.entry)) != w.stat]
        spent = time.monotonic() - t0
        self.sweeps += 1
        for entry in changed:
            log.debug("slab %d:%d: %s changed; checking it", entry.layer, entry.expert, entry.path)
            stat, bad = self._hash(entry, pace)
            self._apply(entry, stat, bad, self._round)
        return max(self.watch_seconds, spent / WATCH_SHARE)

    def _path(self, entry: SlabEntry) -> Path:
        return self.directory / entry.path

    def _hash(self, entry: SlabEntry, pace: _Pace) -> tuple[FileStat | None, str | None]:
        """(the file's stat before it was read, what fails in it or None) against its manifest entry."""
        from swarm.sharding.slabs import check_slab_file

        path = self._path(entry)
        stat = file_stat(path)  # before reading: a change while it is read shows at the next sweep
        pace.restart()
        bad = check_slab_file(self.directory, entry, self.chunk, pace)
        _forget_pages(path)
        return stat, bad

    def _apply(self, entry: SlabEntry, stat: FileStat | None, bad: str | None, round_: int) -> None:
        """A file's verdict (on the stat thread): drop its slab when it fails, take it back when it passes
        again."""
        key = (entry.layer, entry.expert)
        self.hashes[key] += 1
        watched = _Watched(entry, stat, round_)
        was_dropped = key in self._dropped
        if bad is None and was_dropped:
            try:
                self.on_restored(entry)
            except (OSError, ValueError) as e:
                log.warning("slab %d:%d matches the manifest again but cannot be served: %s", *key, e)
                self._dropped[key] = watched
                return
        if bad is None:
            self._dropped.pop(key, None)
            self._served[key] = watched
            return
        self._served.pop(key, None)
        self._dropped[key] = watched
        if not was_dropped:
            self.on_failed(entry, str(self.directory / bad))
