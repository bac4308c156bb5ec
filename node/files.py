"""What a node gives out of its shard directory (the Fetch call): the manifest and the slab files it holds.

A node offers a file only while it serves it, that is once the slab verified against the manifest (at start,
or when a fetch of its own finished it) and until its own check of the file finds it changed, so a fetching
node never gets bytes this node has not checked. A path is matched against that set as the text the
manifest writes ('/'-separated, relative); anything that could name another file (absolute, '..', '.',
backslashes, empty parts) is refused before any file is opened, so no request reaches outside the directory.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from swarm.proto.channel import FETCH_CHUNK_BYTES
from swarm.sharding.manifest import MANIFEST_NAME, slab_relpath


class BadPath(ValueError):
    """A path that is not one a shard directory's files could have (INVALID_ARGUMENT)."""


class NotOffered(LookupError):
    """A well-formed path of a file this node does not give out (NOT_FOUND)."""


def check_relpath(path: str) -> str:
    """`path` if it has the form of a shard file's path; BadPath saying why otherwise."""
    if not path:
        raise BadPath("empty path; ask for manifest.json or experts/<layer>/<expert>.gguf")
    if "\\" in path or "\0" in path or path.startswith("/"):
        raise BadPath(
            f"path {path!r} is not relative to the shard directory; use '/'-separated relative paths"
        )
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise BadPath(f"path {path!r} has an empty, '.' or '..' part; paths stay inside the shard directory")
    return path


class ShardFiles:
    """The files one node gives out: manifest.json and the slab files it has added (each verified)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._sizes: dict[str, int | None] = {MANIFEST_NAME: None}  # None: the size on disk now
        self._lock = threading.Lock()

    def add_slab(self, layer: int, expert: int, size: int) -> None:
        with self._lock:
            self._sizes[slab_relpath(layer, expert)] = size

    def remove_slab(self, layer: int, expert: int) -> None:
        """Give this slab's file out no more (it failed the node's check of its own files)."""
        with self._lock:
            self._sizes.pop(slab_relpath(layer, expert), None)

    def __contains__(self, path: str) -> bool:
        with self._lock:
            return path in self._sizes

    def open(self, path: str, offset: int) -> tuple[BinaryIO, int]:
        """(the file opened at `offset`, its size); BadPath, NotOffered or OSError when it cannot be given."""
        check_relpath(path)
        with self._lock:
            if path not in self._sizes:
                raise NotOffered(
                    f"this node does not give out {path}: it serves manifest.json and the slabs it holds "
                    "(see its Info); ask a node that holds that slab"
                )
            expect = self._sizes[path]
        f = open(self.directory / path, "rb")  # noqa: SIM115 - closed by chunks()
        size = os.fstat(f.fileno()).st_size
        if expect is not None and size != expect:
            f.close()
            raise NotOffered(f"{path} has changed on this node since it verified; ask another holder")
        if offset > size:
            f.close()
            raise BadPath(f"offset {offset} is past the end of {path} ({size} bytes)")
        f.seek(offset)
        return f, size


def chunks(f: BinaryIO, offset: int, size: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) pieces of an opened file from `offset` to `size`, at least one (empty at the end);
    closes the file. OSError when the file ends early (it shrank while being read)."""
    with f:
        if offset == size:
            yield offset, b""
            return
        while offset < size:
            data = f.read(min(FETCH_CHUNK_BYTES, size - offset))
            if not data:
                raise OSError(f"the file ended at byte {offset} of {size}")
            yield offset, data
            offset += len(data)
