"""Wire constants shared by every client and server: protocol version, size limits, channel options, authentication (swarm.node.auth).

Both ends build their channels and servers from CHANNEL_OPTIONS so the limits can never disagree.
"""

from __future__ import annotations

# Bumped when a change to expert.proto or its meaning breaks older peers.
# 2: ComputeRequest.numerics (native ggml kernels vs exact float32); a node of version 1 computes float32 only.
# 3: Fetch (a node gives out its shard files) and InfoReply.serves_files.
# 4: rows as 8-bit blocks (DType Q8_0, Q8_K) and answers as F32_PLANES (--wire q8); a node of version 3 refuses them.
# 5: ComputeRequest.inner / ComputeReply.inner (the gate and up products an answer is checked with).
PROTOCOL_VERSION = 5

# The most file bytes one FileChunk of a Fetch stream carries.
FETCH_CHUNK_BYTES = 1 << 20

# The largest message either end sends or accepts. A Compute call carries rows [N, D] in and out, so
# this bounds N*D*itemsize: 64 MiB is 8192 rows of D=2048 in f32 (16384 in f16/bf16). A coordinator
# splits bigger batches into several calls; a message over the limit fails with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

SERVICE_NAME = "swarm.v1.ExpertNode"

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Find a vanished node (phone asleep, laptop lid shut) within about a minute even while idle.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # The server side must accept those pings, or it closes the connection with "too_many_pings".
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    # Nor close it for pings that come too close together: a coordinator whose process stalled (swapping, a
    # debugger, a long GC) sends its missed keepalives back to back, and a GOAWAY "too_many_pings" would drop
    # every call in flight. (Server side; a client ignores it.)
    ("grpc.http2.max_ping_strikes", 0),
    # A node started on an explicit port must fail if the port is taken, not share it silently.
    ("grpc.so_reuseport", 0),
)
