"""The join link's "files" connections, both ends: a node that can reach nothing but its coordinator (a phone,
a device behind NAT), and that holds no swarm key to sign Fetch calls with (an invite gives it none), fetches
the manifest and its slabs from the coordinator's shard directory over the link it dials
(`swarm node DIR --fetch --join INVITE`).

One file a connection, once the link's handshake has proven both ends (swarm.node.link):

    node          {path, offset}
    coordinator   {size}, then the file's bytes from `offset` to `size`; or {error, code}

The coordinator gives out what a node's Fetch gives out, under the same path rules (swarm.node.files): its
manifest.json and the slab files that manifest lists, nothing else of its directory (not the dense weights),
and nothing at all when it runs on a whole GGUF. Each connection is a file from an offset, so a fetch resumes
where its partial file ends. The node's side (`LinkFiles`) has NodeClient.fetch's shape and its errors carry
Fetch's status codes, so the fetch machinery (swarm.node.fetch: resume, a new call when one runs long, every
slab hashed against the manifest before it is served) takes the coordinator as one more source.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import grpc

from swarm.node.errors import NodeCallError
from swarm.node.files import BadPath, NotOffered, ShardFiles, chunks
from swarm.node.link import LINK_TIMEOUT, LinkError, LinkRefused, read_message, send_message, shut
from swarm.proto.channel import FETCH_CHUNK_BYTES
from swarm.sharding.manifest import EXPERTS_DIR, MANIFEST_NAME, read_manifest

log = logging.getLogger(__name__)

FILE_STREAMS = 4  # files the coordinator gives out at once: its CPU is the dense path's first
FIRST_BACKOFF, MAX_BACKOFF = 0.5, 5.0  # seconds between dials while waiting for the coordinator to listen
_ANSWER_CODES = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)  # the codes a refusal may carry (anything else reads as UNKNOWN)


class _Opened(NamedTuple):
    f: BinaryIO
    offset: int
    size: int


class _Refusal(NamedTuple):
    code: grpc.StatusCode
    why: str


class CoordinatorFiles:
    """What a coordinator gives out over its link: the manifest and slab files of the shard directory it runs
    on (`source`; None, or a GGUF: nothing, and each request is told why)."""

    def __init__(self, source: str | Path | None) -> None:
        self.files: ShardFiles | None = None
        self.why_none = ""
        self._slots = threading.BoundedSemaphore(FILE_STREAMS)
        path = Path(source) if source is not None else None
        if path is None:
            self.why_none = "this coordinator gives out no files"
        elif not path.is_dir():
            self.why_none = (
                f"the coordinator runs on a whole GGUF ({path.name}), which has no slab files to give; run "
                "it on a `swarm shard` directory of the model, or fetch from a node that holds one (--peer)"
            )
        elif not (path / EXPERTS_DIR).is_dir():
            self.why_none = (
                f"the coordinator's shard directory {path.name} has no expert slab files ({EXPERTS_DIR}/ is "
                "absent); copy them there, or fetch from a node that holds them (--peer)"
            )
        else:
            self.files = ShardFiles(path)
            for e in read_manifest(path).slabs:
                self.files.add_slab(e.layer, e.expert, e.size)

    def serve(self, sock: socket.socket) -> None:
        """Answer the one request of a proven "files" connection: the file, or an error that says why."""
        try:
            opened = self._open(read_message(sock))
            if isinstance(opened, _Refusal):
                log.info("a joined node's file request was refused: %s", opened.why)
                send_message(sock, {"error": opened.why, "code": opened.code.name})
                return
            f, offset, size = opened
            if not self._slots.acquire(blocking=False):
                f.close()
                why = "the coordinator is giving out as many files as it may; ask again soon"
                send_message(sock, {"error": why, "code": grpc.StatusCode.RESOURCE_EXHAUSTED.name})
                return
            try:
                send_message(sock, {"size": size})
                sock.settimeout(LINK_TIMEOUT)  # a node that takes nothing for this long is gone
                for _, data in chunks(f, offset, size):
                    if data:
                        sock.sendall(data)
            finally:
                self._slots.release()
        except (OSError, LinkError) as e:  # the node went, or the file shrank while read: it asks again
            log.debug("a files connection ended early: %s", e)
        finally:
            shut(sock)

    def _open(self, request: dict[str, Any]) -> _Opened | _Refusal:
        """The file asked for, opened at its offset; else why not."""
        path, offset = request.get("path"), request.get("offset", 0)
        if not isinstance(path, str) or type(offset) is not int or offset < 0:
            why = "a request names a path (text) and an offset (a whole number, 0 or more)"
            return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, why)
        if self.files is None:
            return _Refusal(grpc.StatusCode.FAILED_PRECONDITION, self.why_none)
        try:
            f, size = self.files.open(path, offset)
        except BadPath as e:
            return _Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NotOffered:
            if path in self.files:
                why = f"{path} on the coordinator is not of its manifest's size; fetch that slab from a node"
            else:
                why = f"the coordinator gives out {MANIFEST_NAME} and the slab files it lists, not {path}"
            return _Refusal(grpc.StatusCode.NOT_FOUND, why)
        except OSError as e:
            why = f"the coordinator cannot read {path} ({e.strerror or e}); fetch that slab from a node"
            return _Refusal(grpc.StatusCode.NOT_FOUND, why)
        return _Opened(f, offset, size)


class LinkFileStream:
    """One file from the coordinator from byte `offset` on: iterate for (offset, bytes, file size) pieces, as
    NodeClient.fetch's stream gives them; `cancel()` ends it from another thread. A failure surfaces as
    NodeCallError while iterating, with the code a node's Fetch would give (UNAVAILABLE: the coordinator could
    not be reached or went; DEADLINE_EXCEEDED: `timeout` s passed, the caller goes on from where it got)."""

    def __init__(
        self, address: str, dial: Callable[[], socket.socket], path: str, offset: int, timeout: float | None
    ) -> None:
        self.address, self._dial, self.path, self.offset, self.timeout = address, dial, path, offset, timeout
        self._deadline: float | None = None
        self._sock: socket.socket | None = None
        self._cancelled = False

    def _fail(self, code: grpc.StatusCode, why: str) -> NodeCallError:
        if self._cancelled:
            code, why = grpc.StatusCode.CANCELLED, "cancelled"
        return NodeCallError(self.address, "Fetch", code, why)

    def __iter__(self) -> Iterator[tuple[int, bytes, int]]:
        try:
            self._sock = sock = self._dial()
        except LinkRefused as e:
            raise self._fail(grpc.StatusCode.PERMISSION_DENIED, str(e)) from None
        except (OSError, LinkError) as e:
            raise self._fail(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        if self.timeout is not None:  # from the connection on: the first dial may wait for the coordinator
            self._deadline = time.monotonic() + self.timeout
        at = self.offset
        try:
            if self._cancelled:
                raise self._fail(grpc.StatusCode.CANCELLED, "cancelled")
            sock.settimeout(self._left(LINK_TIMEOUT))
            send_message(sock, {"path": self.path, "offset": self.offset})
            answer = read_message(sock)
            if "error" in answer:
                code = next((c for c in _ANSWER_CODES if c.name == answer.get("code")), None)
                raise self._fail(code or grpc.StatusCode.UNKNOWN, str(answer["error"]))
            size = answer.get("size")
            if type(size) is not int or size < at:
                why = f"the coordinator answered {answer!r} for {self.path}"
                raise self._fail(grpc.StatusCode.INTERNAL, why)
            if at == size:
                yield at, b"", size
            while at < size:
                sock.settimeout(self._left(LINK_TIMEOUT))
                data = sock.recv(min(FETCH_CHUNK_BYTES, size - at))
                if not data:
                    why = f"the coordinator hung up at byte {at} of {size}"
                    raise self._fail(grpc.StatusCode.UNAVAILABLE, why)
                yield at, data, size
                at += len(data)
        except TimeoutError:
            if self._deadline is not None and time.monotonic() >= self._deadline:
                why = f"{self.path}: at byte {at} when the call's time ran out"
                raise self._fail(grpc.StatusCode.DEADLINE_EXCEEDED, why) from None
            why = f"{self.path}: the coordinator went silent at byte {at}"
            raise self._fail(grpc.StatusCode.UNAVAILABLE, why) from None
        except (OSError, LinkError) as e:
            raise self._fail(grpc.StatusCode.UNAVAILABLE, f"{self.path}: at byte {at}: {e}") from None
        finally:
            shut(sock)

    def _left(self, most: float) -> float:
        """What a read may wait now: at most `most`, never past the deadline (a TimeoutError there)."""
        if self._deadline is None:
            return most
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        return min(most, left)

    def cancel(self) -> None:
        self._cancelled = True
        if self._sock is not None:
            shut(self._sock)


class LinkFiles:
    """The coordinator as a fetch source: `fetch` as NodeClient.fetch, each call a "files" connection of its
    own, dialed by `dial` (swarm.node.join). Until one dial has reached the coordinator, a dial that finds
    nobody listening is tried again for up to `first_wait` s (it may still be loading its model)."""

    def __init__(self, address: str, dial: Callable[[], socket.socket], first_wait: float) -> None:
        self.address = address
        self._dial_once = dial
        self._first_deadline = time.monotonic() + first_wait
        self._reached = False

    def _dial(self) -> socket.socket:
        backoff = FIRST_BACKOFF
        while True:
            try:
                sock = self._dial_once()
            except OSError as e:
                if self._reached or time.monotonic() + backoff > self._first_deadline:
                    raise OSError(
                        f"no coordinator answers ({e}); is `swarm serve`/`run` running there with --listen, "
                        "and does the network let this device reach that port?"
                    ) from None
                time.sleep(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)
                continue
            self._reached = True
            return sock

    def fetch(self, path: str, offset: int = 0, timeout: float | None = None) -> LinkFileStream:
        return LinkFileStream(self.address, self._dial, path, offset, timeout)

    def close(self) -> None:
        """Nothing is kept between calls: each was its own connection."""
