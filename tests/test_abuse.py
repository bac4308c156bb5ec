"""A node under a storm of malformed calls: every call answered with a status in bounded time, other clients
served throughout, memory flat, and SIGTERM still stops it within 2 s. Real node processes, real gRPC."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter

import grpc
import numpy as np
import psutil
import pytest
import torch
from conftest import FIXTURES

from swarm.coordinator.cli.spawn import start_nodes
from swarm.node.auth import AUTH_METADATA, KEY_ENV, Signer, SwarmKey, generate_key_text
from swarm.node.client import NodeClient
from swarm.proto import expert_pb2 as pb
from swarm.proto.channel import CHANNEL_OPTIONS, SERVICE_NAME

GGUF = FIXTURES / "qwen35moe-quant" / "model-q4_k_m.gguf"  # D = 256, 8 experts, Q4_K/Q6_K
D = 256
CALLS = 10_000
THREADS = 4
SLOW_CALL_S = 10.0  # "bounded time": far above any honest call here, far below a hang


def _rows(rng: random.Random, shape: list[int], fill: float | None = None) -> pb.Tensor:
    n = int(np.prod(shape))
    data = (
        np.full(n, fill, np.float32) if fill is not None else np.frombuffer(rng.randbytes(4 * n), np.float32)
    )
    return pb.Tensor(dtype=pb.F32, shape=shape, data=data.tobytes())


def malformed(rng: random.Random) -> bytes:
    """One bad request body: garbage, absurd shapes, counts, ids, layers, enums, widths, NaNs, sizes."""
    k = rng.randrange(15)
    if k == 0:
        return rng.randbytes(rng.randrange(0, 4096))
    base = {"layer": 0, "expert_ids": [0], "counts": [1]}
    if k == 1:
        r = pb.ComputeRequest(**{**base, "layer": rng.randrange(2**32)}, rows=_rows(rng, [1, D]))
    elif k == 2:
        ids = [rng.randrange(2**32) for _ in range(rng.randrange(1, 5000))]
        r = pb.ComputeRequest(layer=0, expert_ids=ids, counts=[1], rows=_rows(rng, [1, D]))
    elif k == 3:
        r = pb.ComputeRequest(**{**base, "counts": [2**32 - 1]}, rows=_rows(rng, [1, D]))
    elif k == 4:
        r = pb.ComputeRequest(**base, rows=pb.Tensor(dtype=pb.F32, shape=[2**63, 2**63], data=b"x" * 16))
    elif k == 5:
        r = pb.ComputeRequest(**base, rows=pb.Tensor(dtype=pb.F32, shape=[0, 2**62], data=b""))
    elif k == 6:
        r = pb.ComputeRequest(**base, rows=pb.Tensor(dtype=77, shape=[1, D], data=b"x" * 4 * D))
    elif k == 7:
        r = pb.ComputeRequest(
            layer=0, expert_ids=[0] * 3, counts=[1] * 3, rows=_rows(rng, [3, D]), numerics=99, out_dtype=55
        )
    elif k == 8:
        r = pb.ComputeRequest(
            layer=0,
            expert_ids=[0, 1],
            counts=[1, 1],
            rows=_rows(rng, [2, D], np.nan),
            numerics=rng.choice([1, 2]),
        )
    elif k == 9:
        r = pb.ComputeRequest(
            **base, rows=pb.Tensor(dtype=pb.F32, shape=[1] * rng.randrange(3, 200), data=b"x" * 4)
        )
    elif k == 10:
        r = pb.ComputeRequest(
            layer=0, expert_ids=list(range(8)) * 1000, counts=[0] * 8000, rows=_rows(rng, [0, D])
        )
    elif k == 11:
        r = pb.ComputeRequest(**base, fingerprint="x" * 100_000, rows=_rows(rng, [1, D]))
    elif k == 12:
        n = rng.randrange(256, 2048)  # big but legal: real work, native or exact
        r = pb.ComputeRequest(
            layer=0, expert_ids=[0], counts=[n], rows=_rows(rng, [n, D]), numerics=rng.choice([1, 2])
        )
    elif k == 13:
        r = pb.ComputeRequest(**base, rows=pb.Tensor(dtype=pb.F32, shape=[1, D], data=b"x" * (4 * D + 1)))
    else:
        r = pb.ComputeRequest(**base, rows=_rows(rng, [1, D + 1]))
    return r.SerializeToString()


@pytest.mark.slow
@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "open"])
def test_ten_thousand_malformed_calls(tmp_path, keyed):
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    text = generate_key_text()
    key = SwarmKey.from_text(text) if keyed else None
    (node,) = start_nodes(
        [(GGUF, ["--no-mdns", "--threads", "1"])], tmp_path, env={KEY_ENV: text if keyed else ""}
    )
    proc = psutil.Process(node.pid)
    signer = Signer(key) if key else None
    channel = grpc.insecure_channel(node.address, options=CHANNEL_OPTIONS)
    stubs = {
        m: channel.unary_unary(f"/{SERVICE_NAME}/{m}", request_serializer=None, response_deserializer=None)
        for m in ("Compute", "Info", "Stats", "NoSuchMethod")
    }
    codes: Counter[str] = Counter()
    slowest = [0.0]
    rss: dict[int, int] = {}
    lock = threading.Lock()
    done = [0]

    def storm(worker: int) -> None:
        rng = random.Random(seed + worker)
        for _ in range(CALLS // THREADS):
            body = malformed(rng)
            method = rng.choice(["Compute"] * 8 + ["Info", "Stats", "NoSuchMethod"])
            token = {
                0: None,
                1: signer.token(f"/{SERVICE_NAME}/{method}", body) if signer else None,
                2: "v1." + "0" * 16 + ".1.1." + "f" * 64,
                3: rng.randbytes(30).hex(),
            }[rng.randrange(4)]
            t0 = time.perf_counter()
            try:
                stubs[method](body, timeout=60, metadata=((AUTH_METADATA, token),) if token else None)
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            dt = time.perf_counter() - t0
            with lock:
                codes[code] += 1
                slowest[0] = max(slowest[0], dt)
                done[0] += 1
                if done[0] in (2_000, CALLS):
                    rss[done[0]] = proc.memory_info().rss

    honest_latency: list[float] = []
    honest_errors: list[str] = []
    stop = threading.Event()

    def honest() -> None:
        with NodeClient(node.address, key=key) as c:
            x = torch.randn(2, D)
            expect = c.compute(0, [0, 1], [1, 1], x)
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    assert torch.equal(c.compute(0, [0, 1], [1, 1], x, timeout=30), expect)
                except Exception as e:  # noqa: BLE001 - every failure is reported below
                    honest_errors.append(repr(e)[:300])
                honest_latency.append(time.perf_counter() - t0)
                time.sleep(0.02)

    other = threading.Thread(target=honest)
    other.start()
    workers = [threading.Thread(target=storm, args=(w,)) for w in range(THREADS)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        stop.set()
        other.join()
        channel.close()
    try:
        assert sum(codes.values()) == CALLS, codes
        assert "INTERNAL" not in codes and "UNKNOWN" not in codes, codes  # every bad call refused as such
        if keyed:
            assert codes["UNAUTHENTICATED"] > CALLS // 2, codes
        assert slowest[0] < SLOW_CALL_S, f"a call took {slowest[0]:.1f} s (seed {seed})"
        assert not honest_errors, honest_errors[:3]
        assert len(honest_latency) > 20 and max(honest_latency) < SLOW_CALL_S
        grew = rss[CALLS] - rss[2_000]
        assert grew < 96 << 20, f"RSS grew {grew / 2**20:.0f} MiB from call 2,000 to {CALLS} (seed {seed})"
        assert proc.is_running()
    finally:
        t0 = time.monotonic()
        node.process.send_signal(signal.SIGTERM)
        node.terminated = True
        code = node.stop(timeout=10.0)
    took = time.monotonic() - t0
    assert code == 0 and took < 2.0, f"SIGTERM: exit {code} after {took:.1f} s\n{node.log_tail()}"
    log = node.log_tail(100_000)
    assert "Traceback" not in log, log[-3000:]
