"""What a node answers to Info, Stats and Fetch, as NodeClient hands it on: NodeInfo and NodeStats (read
from their proto replies) and FileStream (a Fetch call's pieces)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from swarm.node.errors import wrap_rpc_error
from swarm.proto import expert_pb2 as pb
from swarm.proto.codec import held_from_proto
from swarm.sharding.identity import ModelIdentity
from swarm.sharding.slabs import SlabKey


@dataclass(frozen=True)
class NodeInfo:
    address: str
    fingerprint: str
    protocol_version: int
    held: frozenset[SlabKey]
    device: str
    memory_budget_bytes: int
    max_message_bytes: int
    workers: int
    hidden_size: int
    name: str
    version: str
    source_sha256: str = ""  # the source GGUF's header hash; "" from an older node
    serves_files: bool = False  # gives out manifest.json and its held slabs' files (Fetch)
    stream_port: int = 0  # its compute stream's port (swarm.node.streams); 0: none
    numerics_class: str = ""  # its ggml build's class (swarm.compute.numclass); "" from an older node

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity(self.fingerprint, self.source_sha256)

    @classmethod
    def from_reply(cls, address: str, r: pb.InfoReply) -> NodeInfo:
        return cls(
            address=address,
            fingerprint=r.fingerprint,
            protocol_version=r.protocol_version,
            held=frozenset(held_from_proto(r.held)),
            device=r.device,
            memory_budget_bytes=r.memory_budget_bytes,
            max_message_bytes=r.max_message_bytes,
            workers=r.workers,
            hidden_size=r.hidden_size,
            name=r.node_name,
            version=r.version,
            source_sha256=r.source_sha256,
            serves_files=r.serves_files,
            stream_port=r.stream_port,
            numerics_class=r.numerics_class,
        )


@dataclass(frozen=True)
class NodeStats:
    calls: int
    rows: int
    errors: int
    experts: dict[SlabKey, tuple[int, int]]  # (layer, expert) -> (calls, rows)
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_bytes: int
    busy_seconds: float
    uptime_seconds: float
    in_flight: int
    dropped: frozenset[SlabKey] = frozenset()  # slabs it stopped serving: their files failed its check

    @classmethod
    def from_reply(cls, r: pb.StatsReply) -> NodeStats:
        return cls(
            calls=r.calls,
            rows=r.rows,
            errors=r.errors,
            experts={(c.layer, c.expert): (c.calls, c.rows) for c in r.experts},
            cache_hits=r.cache_hits,
            cache_misses=r.cache_misses,
            cache_evictions=r.cache_evictions,
            cache_bytes=r.cache_bytes,
            busy_seconds=r.busy_seconds,
            uptime_seconds=r.uptime_seconds,
            in_flight=r.in_flight,
            dropped=frozenset(held_from_proto(r.dropped)),
        )


class FileStream:
    """One Fetch call: iterate for (offset, bytes, file size) pieces; `cancel()` ends it from another thread.
    A failure surfaces as NodeCallError while iterating."""

    def __init__(self, address: str, call: Any) -> None:
        self.address = address
        self._call = call

    def __iter__(self) -> Iterator[tuple[int, bytes, int]]:
        try:
            for chunk in self._call:
                yield chunk.offset, chunk.data, chunk.size
        except grpc.RpcError as e:
            raise wrap_rpc_error(self.address, "Fetch", e) from None

    def cancel(self) -> None:
        self._call.cancel()
