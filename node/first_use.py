"""A node's slabs from its start to their first call: each slab file hashed against the manifest before any
call uses its bytes, and every held slab verified and put in the form native calls multiply it in
(ggml's repacked copy, within the memory budget) on a thread that starts as the node starts serving.

A node of a 35B model holding 64 experts of every layer has 2,560 slab files, ~1.7 GB: hashing and repacking
them all before serving kept a node from its swarm for tens of seconds on a phone. Now it serves at once;
a call that needs a slab the thread has not reached yet hashes that slab itself first (a few milliseconds a
slab), so no call ever multiplies bytes that did not verify. A slab that fails goes where one the self-check
finds failing goes (`on_failed`: served, announced and given out no more, said in the log and in
`swarm status`), and the call is refused for it as for a slab never held (MissingSlabs: the coordinator
sends those pairs to another holder). Verified slabs are handed to the self-check (`on_verified`), which
watches them from then on.

Whole GGUFs and --no-verify have nothing to hash against: the thread only makes the copies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.sharding.manifest import SlabEntry
    from swarm.sharding.slabs import SlabKey

log = logging.getLogger(__name__)


class FirstUse:
    """Verification before first use, and the start-up thread over every held slab (module docstring).

    `unverified`: the manifest entries of the held slabs not hashed yet. `on_failed(entry, why, since_ns)` and
    `on_verified(entry, since_ns)` get the time the hashing began (time.time_ns())."""

    def __init__(
        self,
        store: Any,
        directory: str | Path | None,
        unverified: Iterable[SlabEntry],
        on_failed: Callable[[SlabEntry, str, int], None],
        on_verified: Callable[[SlabEntry, int], None],
    ) -> None:
        self.store = store
        self.directory = Path(directory) if directory is not None else None
        self.on_failed = on_failed
        self.on_verified = on_verified
        self._pending: dict[SlabKey, SlabEntry] = {(e.layer, e.expert): e for e in unverified}
        self._locks = {key: threading.Lock() for key in self._pending}
        self._failed: set[SlabKey] = set()
        self.verified = 0  # slabs hashed and found matching
        self.ready = 0  # experts the start-up thread put in their native form
        self.done = threading.Event()  # the start-up thread went over every slab (or stopped)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-first-use", daemon=True)
        if self._pending:
            store.before_use = self.before_use

    def start(self) -> FirstUse:
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def before_use(self, layer: int, experts: Sequence[int]) -> None:
        """Hash the slabs of a call that are not verified yet (the store calls this before using their bytes);
        MissingSlabs names those that fail."""
        if not self._pending:
            return  # every slab verified: the common case costs one test
        bad = [e for e in experts if (layer, e) in self._pending and not self._verify((layer, e))]
        if bad:
            from swarm.compute.store import MissingSlabs

            raise MissingSlabs(layer, bad, self.store.layers())

    def _verify(self, key: SlabKey) -> bool:
        """Hash one slab (once: a second caller waits for the first); whether it matches its manifest entry."""
        from swarm.sharding.slabs import check_slab_file

        lock = self._locks[key]
        with lock:
            entry = self._pending.get(key)
            if entry is None:  # another call or the thread hashed it meanwhile
                return key not in self._failed
            assert self.directory is not None  # entries to verify come from a shard directory's manifest
            since = time.time_ns()
            bad = check_slab_file(self.directory, entry)
            if bad is not None:
                self._failed.add(key)
                self.store.remove(key)  # refused from now on as a slab never held, whatever on_failed does
                del self._pending[key]
                self.on_failed(entry, str(self.directory / bad), since)
                return False
            del self._pending[key]
            self.verified += 1
            self.on_verified(entry, since)
            return True

    def _run(self) -> None:
        """Every held slab in layer order: verified, then its native form made while the budget has room."""
        t0 = time.perf_counter()
        store = self.store
        total = 0
        by_layer: dict[int, list[int]] = {}
        for layer, expert in store.held():
            by_layer.setdefault(layer, []).append(expert)
        try:
            for layer, experts in by_layer.items():
                if store.stack(layer) is not None:
                    continue  # a whole GGUF's layer: one stacked copy, made by stack() just now
                for expert in experts:
                    if self._stop.is_set():
                        return
                    total += 1
                    if (layer, expert) in self._pending and not self._verify((layer, expert)):
                        continue
                    if store.prepare_expert(layer, expert):
                        self.ready += 1
        except Exception:
            log.exception("the start-up pass over this node's slabs stopped; calls verify and copy each slab "
                          "they need themselves")  # fmt: skip
            return
        finally:
            self.done.set()
        log.info(
            "%d slabs verified, %d experts ready for ggml's kernels %.1f s after serving began",
            self.verified, self.ready, time.perf_counter() - t0,
        )  # fmt: skip
        store.say_unprepared(self.ready, total - len(self._failed))
