"""The resume journal of `swarm shard`: which files of an unfinished cut are done, with their hashes."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarm.sharding.pump import write_all

JOURNAL_NAME = ".shard-journal.jsonl"


@dataclass
class Journal:
    """Append-only record of finished files of an unfinished run, keyed by the source's identity."""

    path: Path
    identity: dict[str, Any]
    dense: dict[str, Any] | None = None
    slabs: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)  # lines come from the hashing lanes
    fd: int | None = None

    @staticmethod
    def load(path: Path) -> tuple[dict[str, Any] | None, Journal | None]:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return None, None
        except (OSError, UnicodeDecodeError):
            return None, None
        recs = []
        for line in lines:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the line a killed run was writing
        if not recs or "identity" not in recs[0]:
            return None, None
        j = Journal(path, recs[0]["identity"])
        for r in recs[1:]:
            if "dense" in r:
                j.dense = r["dense"]
            elif "slab" in r:
                j.slabs[(int(r["slab"][0]), int(r["slab"][1]))] = r
        return recs[0]["identity"], j

    def start(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(json.dumps({"identity": self.identity}) + "\n")

    def append(self, rec: dict[str, Any]) -> None:
        line = (json.dumps(rec) + "\n").encode()
        with self.lock:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            write_all(self.fd, line)

    def close(self) -> None:
        with self.lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
