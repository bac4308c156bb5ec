"""Nodes that dial out (`swarm node --join`) on loopback: invites, the link's proofs both ways, a run through a
joined node beside a --peer node, bad invites, impostors, malformed frames, and a link cut mid-generation.
The same through NAT between network namespaces: test_join_netns.py."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES

from swarm.coordinator.cli.spawn import spawn_node, start_nodes, stop_nodes
from swarm.coordinator.experts.remote.joins import JoinListener
from swarm.node.auth import SwarmKey, generate_key_text
from swarm.node.client import NodeClient
from swarm.node.invite import Invite, make_invite, parse_invite
from swarm.node.link import client_context, peer_pin, read_message, send_message
from swarm.proto.frames import read_reply, send_call
from swarm.sharding.errors import UserError
from swarm.sharding.identity import ModelIdentity, identity_of
from swarm.sharding.shard import shard_model

PROMPT = ["--prompt", "A list keeps items in order.", "--max-tokens", "12"]


def _key(tmp: Path, name: str) -> tuple[Path, SwarmKey]:
    text = generate_key_text()
    path = tmp / f"{name}.key"
    path.write_text(text)
    return path, SwarmKey.from_text(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _swarm(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarm.coordinator.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def _invite_file(tmp: Path, invite: Invite, name: str = "invite") -> str:
    path = tmp / f"{name}.txt"
    path.write_text(invite.text())
    return str(path)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("join") / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", d)
    return d


def test_an_invite_reads_back_and_a_damaged_one_is_told_apart(tmp_path):
    _, key = _key(tmp_path, "a")
    invite = make_invite(key, ModelIdentity("ab" * 32, "cd" * 32), ["192.168.1.5:7470", "10.0.0.2:7470"])
    text = invite.text()
    assert parse_invite(text) == invite
    assert parse_invite(text[:40] + "\n" + text[40:]) == invite  # wrapped by a chat app
    assert key.secret.hex() not in text and invite.secret != key.secret
    for damaged in (text[:-6], text[:30], text[:-1] + ("A" if text[-1] != "A" else "B")):
        with pytest.raises(UserError, match="incomplete or altered"):
            parse_invite(damaged)
    with pytest.raises(UserError, match="not a swarm invite"):
        parse_invite("192.168.1.5:7470")
    assert invite.matches(ModelIdentity("ab" * 32, "ee" * 32))  # the shard directory's fingerprint
    assert invite.matches(ModelIdentity("ff" * 32, "cd" * 32))  # the GGUF: its header hash
    assert not invite.matches(ModelIdentity("ff" * 32, "ee" * 32))


def test_swarm_invite_prints_text_and_a_qr_code(tmp_path, shard):
    key_file, key = _key(tmp_path, "a")
    out = _swarm("invite", str(shard), "--key-file", str(key_file), "--address", "10.1.2.3:7470", timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    invite = parse_invite(lines[-1])
    assert invite.addresses == ("10.1.2.3:7470",) and invite.matches(identity_of(shard))
    assert sum("▀" in ln or "█" in ln for ln in lines) > 10  # the QR code's rows
    no_key = _swarm("invite", str(shard), timeout=60)
    assert no_key.returncode == 2 and "--key-file" in no_key.stderr and "Traceback" not in no_key.stderr


@pytest.mark.slow
def test_a_joined_node_and_a_peer_serve_a_run_like_in_process(tmp_path, shard):
    """One node dials out by invite, one is named with --peer: the coordinator takes both together, and the
    answer is the in-process answer."""
    key_file, key = _key(tmp_path, "a")
    port = _free_port()
    invite = make_invite(key, identity_of(shard), [f"127.0.0.1:{port}"])
    env = {"SWARM_KEY_FILE": str(key_file)}
    local = _swarm("run", str(shard), "--local", *PROMPT)  # (before the joined node waits for its coordinator)
    peer = start_nodes([(shard, ["--experts", "0-15", "--no-mdns"])], tmp_path / "peer", env=env)
    # a busy machine may start the coordinator late: the node waits for it longer than the default minute
    joined = spawn_node(shard, ["--experts", "16-31", "--join", _invite_file(tmp_path, invite), "--join-wait", "300"],
                        tmp_path, "j")  # fmt: skip
    try:
        run = _swarm("run", str(shard), "--key-file", str(key_file), "--listen", f"127.0.0.1:{port}",
                      "--peer", peer[0].address, "--no-mdns", "--wait", "60", *PROMPT)  # fmt: skip
        assert run.returncode == 0, run.stderr + joined.log_tail()
        assert run.stdout == local.stdout
        used = [ln.strip() for ln in run.stderr.splitlines() if ln.strip().startswith("node 127.0.0.1:")]
        assert len(used) == 2, run.stderr  # both nodes got calls
        assert "joined the coordinator at" in joined.log_tail(50)
    finally:
        stop_nodes([*peer, joined])


BAD = ["truncated", "another model", "another key", "unreachable", "wrong key file"]


@pytest.mark.slow
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_invite_gets_one_clear_error(tmp_path, shard, bad):
    key_file, key = _key(tmp_path, "a")
    other_file, other = _key(tmp_path, "b")
    listener = JoinListener("127.0.0.1:0", key, identity_of(shard))
    here = f"127.0.0.1:{listener.port}"
    identity = identity_of(shard)
    join, extra, expect = {
        "truncated": (make_invite(key, identity, [here]).text()[:-9], [], "incomplete or altered"),
        "another model": (make_invite(key, ModelIdentity("ab" * 32), [here]).text(), [], "another model"),
        "another key": (make_invite(other, identity, [here]).text(), [], "does not show this swarm's certificate"),
        "unreachable": (make_invite(key, identity, [f"127.0.0.1:{_free_port()}"]).text(), [], "no coordinator answers"),
        "wrong key file": (here, ["--key-file", str(other_file)], "does not show this swarm's certificate"),
    }[bad]  # fmt: skip
    try:
        path = tmp_path / "invite.txt"
        path.write_text(join)
        out = _swarm("node", str(shard), "--threads", "1", "--join", str(path), "--join-wait", "3", *extra)
        assert out.returncode == 2, out.stdout + out.stderr
        errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1 and expect in errors[0], out.stderr
        assert "Traceback" not in out.stdout + out.stderr
        assert listener.nodes() == []
    finally:
        listener.close()


def _impostor(key: SwarmKey, invite: Invite) -> tuple[socket.socket, list[str]]:
    """A listener that shows another key's certificate and answers with the invite's join secret (what a
    holder of the invite, not of the key, could do); what it heard from nodes."""
    import hashlib
    import hmac
    import threading

    from swarm.node.link import server_context

    server = socket.create_server(("127.0.0.1", 0))
    heard: list[str] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            try:
                sock = server_context(key).wrap_socket(conn, server_side=True)
                hello = read_message(sock)
                heard.append(str(hello.get("kind")))
                msg = b"coordinator\0" + bytes.fromhex(hello["nonce"]) + bytes(16) + bytes.fromhex(invite.pin)
                proof = hmac.new(invite.secret, msg, hashlib.sha256).hexdigest()
                send_message(sock, {"nonce": "00" * 16, "proof": proof})
                heard.append(str(read_message(sock)))
            except (OSError, ValueError, ConnectionError):
                pass
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return server, heard


@pytest.mark.slow
def test_an_impostor_coordinator_and_a_wrong_key_node_are_refused_both_ways(tmp_path, shard):
    _, key = _key(tmp_path, "a")
    _, other = _key(tmp_path, "b")
    identity = identity_of(shard)
    # a coordinator that has the invite but not the key: the node hangs up before it says anything
    server, heard = _impostor(other, make_invite(key, identity, ["x:1"]))
    invite = make_invite(key, identity, [f"127.0.0.1:{server.getsockname()[1]}"])
    out = _swarm("node", str(shard), "--threads", "1", "--join", _invite_file(tmp_path, invite), "--join-wait", "3")
    server.close()
    assert out.returncode == 2 and "does not show this swarm's certificate" in out.stderr, out.stderr
    assert heard == [], "the node told the impostor nothing"
    # an invite with the real pin (it is public) and a made-up join secret: neither end takes the other
    listener = JoinListener("127.0.0.1:0", key, identity)
    try:
        real = make_invite(key, identity, [f"127.0.0.1:{listener.port}"])
        forged = Invite(real.addresses, real.fingerprint, real.source_sha256, real.pin, os.urandom(32))
        out = _swarm("node", str(shard), "--threads", "1", "--join", _invite_file(tmp_path, forged, "forged"))
        assert out.returncode == 2 and "cannot prove the swarm key" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        with _tls(listener.port) as s:  # a node that goes on to prove itself with what it has
            hello = {"v": 1, "kind": "control", "node": "1" * 16, "conn": 0, "nonce": "00" * 16,
                     "fingerprint": identity.fingerprint, "source_sha256": identity.source_sha256}  # fmt: skip
            send_message(s, hello)
            assert set(read_message(s)) == {"nonce", "proof"}
            send_message(s, {"proof": "11" * 32})
            verdict = read_message(s)
        assert "another swarm key" in verdict["error"], verdict
        assert listener.nodes() == [] and listener.refused >= 1
    finally:
        listener.close()


def _tls(port: int) -> socket.socket:
    return client_context().wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10))


def _garbage(rng: random.Random, port: int, pin: str, i: int) -> None:
    """One malformed frame at the join listener: raw bytes, or a TLS connection with a broken message."""
    try:
        if i % 3 == 0:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(rng.randbytes(rng.randrange(1, 300)))
            return
        with _tls(port) as s:
            assert peer_pin(s) == pin
            choice = i % 6
            if choice == 1:
                s.sendall((1 << 30).to_bytes(4, "little") + b"{")  # a message over the limit
            elif choice == 2:
                s.sendall((20).to_bytes(4, "little") + rng.randbytes(20))  # not JSON
            elif choice == 4:
                send_message(s, {"v": 1, "kind": "control", "node": "x" * 16, "nonce": "zz"})  # bad nonce
            else:  # a well-formed hello whose proof is wrong
                send_message(s, {"v": 1, "kind": "stream", "node": "0" * 16, "conn": 1, "nonce": "00" * 16})
                read_message(s)
                send_message(s, {"proof": "00" * 32})
            s.settimeout(10)
            s.recv(1024)  # the listener's refusal, or its hang-up
    except OSError:
        pass


@pytest.mark.slow
def test_3000_malformed_frames_leave_both_sides_serving(tmp_path, shard):
    _, key = _key(tmp_path, "a")
    identity = identity_of(shard)
    listener = JoinListener("127.0.0.1:0", key, identity)
    invite = make_invite(key, identity, [f"127.0.0.1:{listener.port}"])
    node = spawn_node(shard, ["--join", _invite_file(tmp_path, invite)], tmp_path, "j")
    try:
        _wait(lambda: listener.nodes(), 60, "the node joined")
        record = listener.nodes()[0]
        rng = random.Random(50)
        for i in range(2000):  # at the coordinator's listener
            _garbage(rng, listener.port, invite.pin, i)
        joined = next(iter(listener._nodes.values()))
        for i in range(500):  # at the node: frames that break the framing, each on a connection of its own
            with joined.dial("stream", 10) as s:
                s.sendall(b"SWc1" + rng.randbytes(8) if i % 2 else rng.randbytes(40))
                s.settimeout(10)
                assert s.recv(64) == b""  # the node hung up on it
        with joined.dial("stream", 10) as s:  # ... and calls that are not ComputeRequests, on one connection
            s.settimeout(10)
            for _ in range(500):
                send_call(s, "", rng.randbytes(rng.randrange(1, 200)))
                code, _ = read_reply(s)
                assert code.name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION")
        assert node.process.poll() is None and listener.nodes() == [record]
        assert listener.refused >= 2000
        client = NodeClient(record.address, fingerprint=record.fingerprint, key=key, dial=record.dial)
        try:
            rows = np.ones((2, record.hidden_size), np.float32)
            out = client.compute(0, [3], [2], rows, timeout=30)
            assert out.shape == (2, record.hidden_size) and np.isfinite(out).all()
            assert client.stats().calls >= 1
        finally:
            client.close()
        assert node.log_tail(50).count("joined the coordinator") == 1, "the link itself never dropped"
    finally:
        node.stop()
        listener.close()


@pytest.mark.slow
def test_a_link_cut_mid_generation_fails_over_and_the_node_comes_back_as_itself(tmp_path, shard):
    """A replica by --peer and a joined node, both holding every expert; the joined node's link is cut after
    the fourth token (its connections closed under its calls). The answer is the in-process answer token for
    token, and the node dials back and is the same node (the same address) to the coordinator."""
    from swarm.coordinator.config import EngineConfig
    from swarm.coordinator.decode.one import SamplingParams, generate
    from swarm.coordinator.engine import open_engine
    from swarm.coordinator.experts.remote.discovery import connect
    from swarm.sharding.slabs import slabs_from_shard

    key_file, key = _key(tmp_path, "a")
    identity = identity_of(shard)
    port = _free_port()
    invite = make_invite(key, identity, [f"127.0.0.1:{port}"])
    peer = start_nodes([(shard, ["--no-mdns"])], tmp_path / "peer", env={"SWARM_KEY_FILE": str(key_file)})
    node = spawn_node(shard, ["--join", _invite_file(tmp_path, invite), "--link-timeout", "3"], tmp_path, "j")
    local = open_engine(shard, EngineConfig(local=True, device="cpu"))
    needed = sorted(slabs_from_shard(shard, verify=False)[0])
    config = EngineConfig(peers=(peer[0].address,), mdns=False, listen=f"127.0.0.1:{port}", key=key, wait=60.0)
    backend = connect(needed, identity, str(shard), config)
    try:
        joins = backend.browser.browsers[-1]
        _wait(lambda: joins.nodes(), 60, "the node joined")  # (the peer alone covers the model: no wait at start)
        (joined,) = joins._nodes.values()
        address = joined.address
        prompt = local.tokenizer.encode("A list keeps items in order.")
        params = SamplingParams(max_tokens=16)
        expect = list(generate(local.model, prompt, params))
        local.model.set_experts(backend)
        got = []
        for token in generate(local.model, prompt, params):
            got.append(token)
            if len(got) == 4:
                assert backend.calls_per_node[address] > 0, "the joined node was in use before"
                joined.link.close()
        assert got == expect
        _wait(lambda: node.log_tail(50).count("joined the coordinator") == 2, 30, "the node dialed back")
        _wait(lambda: [n.address for n in joins.nodes()] == [address], 30, "the node is listed again")
        before = backend.calls_per_node[address]
        assert list(generate(local.model, prompt, params)) == expect
        assert backend.calls_per_node[address] > before, "the node that came back takes calls again"
    finally:
        backend.close()
        local.close()
        stop_nodes([*peer, node])


@pytest.mark.slow
def test_swarm_serve_lists_a_joined_node_on_its_map_metrics_and_status(tmp_path, shard):
    """A joined node answers Stats through its link: the server's map, its metrics and `swarm status
    --server` show it with its calls."""
    import json
    import urllib.request

    from swarm.coordinator.cli.spawn import spawn_swarm

    key_file, key = _key(tmp_path, "a")
    port = _free_port()
    invite = make_invite(key, identity_of(shard), [f"127.0.0.1:{port}"])
    node = spawn_node(shard, ["--join", _invite_file(tmp_path, invite)], tmp_path, "j")
    server = spawn_swarm(["serve", str(shard), "--key-file", str(key_file), "--listen", f"127.0.0.1:{port}",
                          "--no-mdns", "--wait", "60"], tmp_path, "serve")  # fmt: skip
    try:
        url = f"http://{server.wait_ready(180).address}"
        body = json.dumps({"model": server.ready["model_id"], "prompt": "A list", "max_tokens": 4}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert json.load(answer)["choices"][0]["text"]

        def listed() -> bool:
            with urllib.request.urlopen(f"{url}/swarm.json", timeout=10) as answer:
                nodes = json.load(answer)["nodes"]
            return len(nodes) == 1 and nodes[0]["answering"] and (nodes[0]["calls"] or 0) > 0

        _wait(listed, 60, "the map lists the joined node with its calls")
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert "swarm_node_up{node=\"127.0.0.1:" in metrics
        status = _swarm("status", "--server", url, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "127.0.0.1:" in status.stdout and "0-3:0-31" in status.stdout.replace(" ", ""), status.stdout
    finally:
        stop_nodes([server, node])
