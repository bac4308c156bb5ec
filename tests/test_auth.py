"""The swarm key on the wire: calls authenticated without the key crossing it; forged, altered, replayed and
unauthenticated calls refused; TLS keeps activations private; the key never on a command line.

Real node processes on 127.0.0.1, a real byte-logging TCP proxy (tests/tcp_proxy.py) between client and node.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import grpc
import psutil
import pytest
import torch
from conftest import FIXTURES
from tcp_proxy import TcpProxy

from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import start_nodes, stop_nodes
from swarm.node.auth import AUTH_METADATA, KEY_ENV, Signer, SwarmKey, Verifier, generate_key_text
from swarm.node.client import NodeCallError, NodeClient
from swarm.proto import expert_pb2 as pb
from swarm.proto.channel import CHANNEL_OPTIONS, PROTOCOL_VERSION, SERVICE_NAME
from swarm.proto.codec import compute_request

GGUF = FIXTURES / "qwen3moe-tiny" / "model-f32.gguf"  # D = 64
KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
COMPUTE = f"/{SERVICE_NAME}/Compute"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """plain: keyed, plaintext on loopback (the default there); tls: keyed, --tls on."""
    work = tmp_path_factory.mktemp("auth")
    key_file = work / "swarm.key"
    key_file.write_text(KEY_TEXT)
    kf = ["--key-file", str(key_file), "--no-mdns"]
    started = start_nodes([(GGUF, kf), (GGUF, [*kf, "--tls", "on"])], work / "nodes")
    yield dict(zip(("plain", "tls"), started, strict=True))
    assert stop_nodes(started) == [0, 0]


def _rows() -> torch.Tensor:
    # a recognisable activation pattern: the proxy test looks for these bytes on the wire
    return torch.full((2, 64), 1234.5678, dtype=torch.float32)


def _raw_call(address: str, body: bytes, token: str | None) -> grpc.StatusCode:
    """One Compute call with exactly these bytes and this token (what a replaying or forging listener sends)."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = ch.unary_unary(
            COMPUTE, request_serializer=None, response_deserializer=pb.ComputeReply.FromString
        )
        try:
            stub(body, timeout=10, metadata=((AUTH_METADATA, token),) if token is not None else None)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_a_listener_never_sees_the_key_and_cannot_forge_alter_or_replay(nodes):
    node = nodes["plain"]
    proxy = TcpProxy(node.address, keep=True)
    try:
        with NodeClient(proxy.address, fingerprint=node.fingerprint, key=KEY) as client:
            out = client.compute(0, [0, 1], [1, 1], _rows())
            assert out.shape == (2, 64)
            assert client.info().hidden_size == 64
    finally:
        proxy.close()
    wire = bytes(proxy.seen)
    assert _rows().numpy().tobytes()[:64] in wire, "the proxy saw the call (plaintext on loopback)"
    for secret in (
        KEY_TEXT.encode(),
        KEY.secret,
        KEY.secret.hex().encode(),
        KEY._auth_key,
        KEY._auth_key.hex().encode(),
    ):
        assert secret not in wire

    # what a listener could do with a captured call: send it again, change it, or make one up
    body = compute_request(
        0, [0], [1], _rows()[:1], node.fingerprint, protocol_version=PROTOCOL_VERSION
    ).SerializeToString()
    token = Signer(KEY).token(COMPUTE, body)
    assert _raw_call(node.address, body, token) == grpc.StatusCode.OK
    assert _raw_call(node.address, body, token) == grpc.StatusCode.UNAUTHENTICATED  # replayed
    altered = compute_request(
        0, [1], [1], _rows()[:1], node.fingerprint, protocol_version=PROTOCOL_VERSION
    ).SerializeToString()
    assert (
        _raw_call(node.address, altered, Signer(KEY).token(COMPUTE, body)) == grpc.StatusCode.UNAUTHENTICATED
    )
    forged = Signer(SwarmKey.from_text("a guess")).token(COMPUTE, body)
    assert _raw_call(node.address, body, forged) == grpc.StatusCode.UNAUTHENTICATED
    assert _raw_call(node.address, body, None) == grpc.StatusCode.UNAUTHENTICATED
    assert _raw_call(node.address, body, "v1.garbage") == grpc.StatusCode.UNAUTHENTICATED
    # a token made for another method does not open this one
    assert _raw_call(node.address, body, Signer(KEY).token(f"/{SERVICE_NAME}/Info", body)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # a stale call (a replay after the node forgot its session) is refused by its clock
    stale = Signer(KEY, clock=lambda: 1e9).token(COMPUTE, body)
    assert _raw_call(node.address, body, stale) == grpc.StatusCode.UNAUTHENTICATED
    with NodeClient(node.address, key=SwarmKey.from_text("another swarm")) as wrong:
        with pytest.raises(NodeCallError) as e:
            wrong.info()
    assert e.value.code is grpc.StatusCode.UNAUTHENTICATED and "another swarm key" in e.value.details


def test_tls_keeps_activations_private_and_admits_only_key_holders(nodes):
    node = nodes["tls"]
    proxy = TcpProxy(node.address, keep=True)
    try:
        with NodeClient(proxy.address, fingerprint=node.fingerprint, key=KEY, tls=True) as client:
            out = client.compute(0, [0, 1], [1, 1], _rows())
    finally:
        proxy.close()
    with NodeClient(nodes["plain"].address, fingerprint=node.fingerprint, key=KEY) as plain:
        assert torch.equal(out, plain.compute(0, [0, 1], [1, 1], _rows()))  # same model, same answer
    wire = bytes(proxy.seen)
    assert len(wire) > 1000
    assert _rows().numpy().tobytes()[:16] not in wire and node.fingerprint.encode() not in wire
    assert KEY_TEXT.encode() not in wire and KEY.secret not in wire
    # without the key there is no TLS session at all, whatever the client sends
    with NodeClient(node.address, key=SwarmKey.from_text("another swarm"), tls=True) as stranger:
        with pytest.raises(NodeCallError) as e:
            stranger.info(timeout=5)
    assert e.value.code is grpc.StatusCode.UNAVAILABLE
    with NodeClient(node.address, key=KEY, tls=False) as plain:
        with pytest.raises(NodeCallError):
            plain.info(timeout=5)


def test_replay_window_accepts_out_of_order_calls_once():
    v, s = Verifier(KEY), Signer(KEY)
    tokens = [s.token(COMPUTE, b"x") for _ in range(5)]
    for t in (tokens[3], tokens[0], tokens[4], tokens[1], tokens[2]):
        assert v.check(COMPUTE, t, b"x") == ""
    assert all("replayed" in v.check(COMPUTE, t, b"x") for t in tokens)
    assert "tag does not verify" in v.check(COMPUTE, s.token(COMPUTE, b"x"), b"y")


def test_keygen_key_file_and_no_key_on_the_command_line(tmp_path, capsys):
    key_file = tmp_path / "swarm.key"
    assert main(["keygen", "--out", str(key_file)]) == 0
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    text = key_file.read_text().strip()
    assert text.startswith("swarm-key-v1:") and len(text) > 40
    assert main(["keygen", "--out", str(key_file)]) == 2  # never overwrites a key its nodes use
    assert "exists" in capsys.readouterr().err
    assert key_file.read_text().strip() == text

    (node,) = start_nodes([(GGUF, ["--no-mdns", "--key-file", str(key_file)])], tmp_path / "n")
    try:
        cmdline = " ".join(psutil.Process(node.pid).cmdline())
        assert text not in cmdline and str(key_file) in cmdline
        with NodeClient(node.address, key=SwarmKey.load(key_file)) as c:
            assert c.info().hidden_size == 64
        with NodeClient(node.address) as c:
            with pytest.raises(NodeCallError) as e:
                c.info()
        assert e.value.code is grpc.StatusCode.UNAUTHENTICATED and "--key-file" in e.value.details
    finally:
        node.stop()


def test_an_open_node_is_loopback_only_and_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (KEY_ENV, "SWARM_KEY_FILE")}
    cmd = [sys.executable, "-m", "swarm.coordinator.cli", "node", str(GGUF), "--no-mdns", "--host", "0.0.0.0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "without a swarm key" in r.stderr and "swarm keygen" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    (node,) = start_nodes([(GGUF, ["--no-mdns"])], tmp_path, env={KEY_ENV: ""})
    try:
        assert "OPEN swarm node" in node.log_tail(50)
    finally:
        node.stop()
