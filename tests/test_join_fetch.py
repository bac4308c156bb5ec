"""A node that joins fetches its slabs over its link (`swarm node EMPTY_DIR --fetch --join INVITE`): from an
empty directory to a run equal to in-process; an interrupted fetch resumes from its partial file; bad file
requests get one clear error each and the coordinator goes on giving out files; a coordinator on a whole GGUF
says it has none to give. And a coordinator takes a node found by mDNS and a joined one together."""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from conftest import FIXTURES
from tcp_proxy import TcpProxy
from test_join import PROMPT, _free_port, _invite_file, _key, _swarm, _wait

from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import LocalNode, spawn_node, start_nodes, stop_nodes
from swarm.coordinator.experts.remote.joins import JoinListener
from swarm.node.errors import NodeCallError
from swarm.node.invite import make_invite
from swarm.node.join import JoinTarget, dial_any, fetch_link
from swarm.node.link import read_message, send_message
from swarm.node.link_files import LinkFiles
from swarm.sharding.identity import ModelIdentity, identity_of
from swarm.sharding.manifest import read_manifest, slab_relpath
from swarm.sharding.shard import shard_model
from swarm.sharding.slabs import check_slab_file
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import preset

MiB = 1 << 20


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("join-fetch") / "m.swarm"
    shard_model(FIXTURES / "qwen3moe-tiny" / "model-f32.gguf", d)
    return d


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """A 2-layer, 4-expert model of 3 MiB slab files (several 1 MiB chunks each), for a fetch to stop in."""
    work = tmp_path_factory.mktemp("join-fetch-big")
    spec = preset("qwen3moe-tiny", n_layers=2, n_expert=4, n_embd=512, expert_ff=512, experts_type="F32", n_vocab=300)
    shard_model(synthesize(work / "m.gguf", spec), work / "m.swarm")
    return work / "m.swarm"


def _fetched(node: LocalNode, timeout: float = 120.0) -> dict:
    """The node's ready file once its fetch has ended."""
    deadline = time.monotonic() + timeout
    while True:
        ready = json.loads(node.ready_file.read_text()) if node.ready_file.exists() else None
        if ready is not None and ready["pending"] == 0:
            return ready
        assert node.process.poll() is None, node.log_tail()
        assert time.monotonic() < deadline, f"fetch not done after {timeout} s:\n{node.log_tail()}"
        time.sleep(0.05)


def _same_files(dest: Path, model: Path, keys: set[tuple[int, int]]) -> None:
    """dest holds the manifest and exactly these slab files, each verifying and byte for byte the model's."""
    want = {"manifest.json"} | {slab_relpath(*k) for k in keys}
    assert {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} == want
    manifest = read_manifest(dest)
    for layer, expert in keys:
        assert check_slab_file(dest, manifest.slab(layer, expert)) is None
    for rel in want:
        assert (dest / rel).read_bytes() == (model / rel).read_bytes(), rel


@pytest.mark.slow
def test_a_node_on_an_empty_directory_fetches_over_its_link_and_serves_a_run_like_in_process(tmp_path, shard):
    """The node has only the invite (no key, no mDNS, no peer): the manifest and every slab come from the
    coordinator over the link, and the coordinator's run, which waits for them, is the in-process run."""
    key_file, key = _key(tmp_path, "a")
    port = _free_port()
    invite = _invite_file(tmp_path, make_invite(key, identity_of(shard), [f"127.0.0.1:{port}"]))
    local = _swarm("run", str(shard), "--local", *PROMPT)
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "swarm.coordinator.cli", "run", str(shard), "--key-file", str(key_file),
         "--listen", f"127.0.0.1:{port}", "--no-mdns", "--wait", "120", *PROMPT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    dest = tmp_path / "phone"
    node = spawn_node(dest, ["--fetch", "--join", invite, "--no-mdns", "--join-wait", "300"], tmp_path, "phone")
    try:
        out, err = coordinator.communicate(timeout=300)
        assert coordinator.returncode == 0, err + node.log_tail()
        assert out == local.stdout
        assert _fetched(node)["fetch_failed"] == []
        every = {(e.layer, e.expert) for e in read_manifest(shard).slabs}
        _same_files(dest, shard, every)
        log = node.log_file.read_text()
        assert f"fetched {len(every)} slabs" in log and "from 1 sources" in log, log
        assert "joined the coordinator at" in log
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
            coordinator.communicate()
        assert node.stop() == 0, node.log_tail()


def _parts(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.rglob("*.part")}


@pytest.mark.slow
def test_an_interrupted_fetch_over_the_link_resumes_from_its_partial_file(tmp_path, big):
    _, key = _key(tmp_path, "a")
    listener = JoinListener("127.0.0.1:0", key, identity_of(big), files=big)
    proxy = TcpProxy(f"127.0.0.1:{listener.port}", rate=2 * MiB)  # slow enough to stop mid-file
    invite = _invite_file(tmp_path, make_invite(key, identity_of(big), [proxy.address]))
    dest = tmp_path / "k"
    args = ["--fetch", "--join", invite, "--no-mdns", "--slab", "1:0-1", "--fetch-parallel", "1"]
    try:
        k = spawn_node(dest, args, tmp_path, "k").wait_ready(60)
        # it joins once the manifest is in place, holding nothing yet; each slab it verifies is told to the link
        _wait(lambda: [n.held for n in listener.nodes()] == [set()], 30, "the node joined, holding nothing")
        _wait(lambda: [n.held for n in listener.nodes()] == [{(1, 0)}], 30, "the coordinator sees its first slab")
        _wait(lambda: _parts(dest).get("1.gguf.part", 0) >= MiB, 30, "a MiB of the second slab")
        k.process.send_signal(signal.SIGINT)  # Ctrl-C
        assert k.process.wait(20) == 0, k.log_tail()
        assert "the partial files are kept" in k.log_file.read_text()
        parts = {p: p.read_bytes() for p in dest.rglob("*.part")}
        assert parts and all(len(b) >= MiB for b in parts.values())
        for p, data in parts.items():  # a prefix of the real file
            real = (big / p.relative_to(dest).as_posix().removesuffix(".part")).read_bytes()
            assert real[: len(data)] == data
        kept = sum(len(b) for b in parts.values())
        done = {p.relative_to(dest).as_posix() for p in dest.rglob("*.gguf")}
        remaining = sum((big / slab_relpath(1, e)).stat().st_size for e in (0, 1)) - kept
        remaining -= sum((big / rel).stat().st_size for rel in done)
        proxy.rate, proxy.sent = 64 * MiB, 0
        k2 = spawn_node(dest, args, tmp_path, "k2").wait_ready(60)
        assert _fetched(k2)["fetch_failed"] == []
        _same_files(dest, big, {(1, 0), (1, 1)})
        # not again from byte 0 (the rest: the manifest read again, TLS handshakes, the link's own calls)
        assert proxy.sent <= remaining + 256 * 1024, (proxy.sent, remaining)
        assert f"{kept / MiB:.1f} MiB resumed from partial files" in k2.log_file.read_text()
        _wait(lambda: [n.held for n in listener.nodes()] == [{(1, 0), (1, 1)}], 30, "the coordinator sees both")
        assert k2.stop() == 0
    finally:
        proxy.close()
        listener.close()


def _link(join: str) -> LinkFiles:
    """The node's side of "files" connections, as `swarm node --fetch --join` makes it."""
    return fetch_link(argparse.Namespace(join=join, name="t", join_wait=5.0), None, None)


def test_bad_file_requests_get_clear_errors_and_the_coordinator_goes_on(tmp_path, shard):
    _, key = _key(tmp_path, "a")
    copy = tmp_path / "c.swarm"
    shutil.copytree(shard, copy)
    (copy / slab_relpath(1, 5)).unlink()  # listed in the manifest, gone from the directory
    identity = identity_of(shard)
    listener = JoinListener("127.0.0.1:0", key, identity, files=copy)
    invite = make_invite(key, identity, [f"127.0.0.1:{listener.port}"])
    manifest = (shard / "manifest.json").read_bytes()
    try:
        link = _link(invite.text())
        cases = [
            ("../m.swarm/manifest.json", 0, grpc.StatusCode.INVALID_ARGUMENT, "'..' part"),
            ("/etc/passwd", 0, grpc.StatusCode.INVALID_ARGUMENT, "not relative"),
            ("experts/0/../../manifest.json", 0, grpc.StatusCode.INVALID_ARGUMENT, "'..' part"),
            ("experts\\0\\1.gguf", 0, grpc.StatusCode.INVALID_ARGUMENT, "not relative"),
            ("", 0, grpc.StatusCode.INVALID_ARGUMENT, "empty path"),
            ("dense.gguf", 0, grpc.StatusCode.NOT_FOUND, "slab files it lists, not dense.gguf"),
            ("experts/0/99.gguf", 0, grpc.StatusCode.NOT_FOUND, "slab files it lists"),
            (slab_relpath(1, 5), 0, grpc.StatusCode.NOT_FOUND, "cannot read"),
            ("manifest.json", len(manifest) + 1, grpc.StatusCode.INVALID_ARGUMENT, "past the end"),
            ("manifest.json", 1 << 62, grpc.StatusCode.INVALID_ARGUMENT, "past the end"),
            ("manifest.json", -1, grpc.StatusCode.INVALID_ARGUMENT, "an offset"),
        ]
        for path, offset, code, words in cases:
            with pytest.raises(NodeCallError) as e:
                list(link.fetch(path, offset, timeout=10))
            assert e.value.code == code and words in e.value.details, (path, e.value)
        target = JoinTarget((f"127.0.0.1:{listener.port}",), invite.pin, invite.secret)
        hello = {"kind": "files", "conn": 0, "node": "1" * 16, "fingerprint": "", "source_sha256": ""}
        for raw in (b"\x05\x00\x00\x00{nope", (1 << 30).to_bytes(4, "little"), b""):  # broken requests
            sock, _ = dial_any(target, hello)
            with sock:
                sock.sendall(raw)
                if not raw:
                    send_message(sock, {"path": 7, "offset": "x"})
                    assert "an offset" in read_message(sock)["error"]
                sock.settimeout(10)
                assert sock.recv(64) == b""  # answered (or hung up on), and closed
        # a node that asks for another model's files is refused before it asks for any
        other = make_invite(key, ModelIdentity("ab" * 32, "cd" * 32), invite.addresses)
        with pytest.raises(NodeCallError) as e:
            list(_link(other.text()).fetch("manifest.json"))
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED and "the node fetches abababab" in e.value.details
        # ... and the coordinator goes on giving out files, from any offset
        assert b"".join(data for _, data, _ in link.fetch("manifest.json")) == manifest
        slab = (shard / slab_relpath(0, 3)).read_bytes()
        assert b"".join(data for _, data, _ in link.fetch(slab_relpath(0, 3), 1000)) == slab[1000:]
        assert [size for _, _, size in link.fetch("manifest.json", len(manifest))] == [len(manifest)]
    finally:
        listener.close()


@pytest.mark.parametrize("case", ["a whole GGUF", "another model"])
def test_a_coordinator_with_no_files_to_give_says_so(tmp_path, shard, case, capsys):
    _, key = _key(tmp_path, "a")
    gguf = FIXTURES / "qwen3moe-tiny" / "model-f32.gguf"
    source = gguf if case == "a whole GGUF" else shard
    listener = JoinListener("127.0.0.1:0", key, identity_of(source), files=source)
    model = identity_of(source) if case == "a whole GGUF" else ModelIdentity("ab" * 32)
    invite = _invite_file(tmp_path, make_invite(key, model, [f"127.0.0.1:{listener.port}"]))
    try:
        assert main(["node", str(tmp_path / "empty"), "--fetch", "--join", invite, "--no-mdns"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        expect = "runs on a whole GGUF" if case == "a whole GGUF" else "this coordinator runs model"
        assert "no files from the coordinator" in err[0] and expect in err[0], err
        assert not (tmp_path / "empty" / "manifest.json").exists()
    finally:
        listener.close()


@pytest.mark.slow
def test_a_node_found_by_mdns_and_a_joined_one_serve_one_run_like_in_process(tmp_path, shard):
    """Half the experts on a node that mDNS finds (on loopback), half on one that joins by invite."""
    key_file, key = _key(tmp_path, "a")
    port = _free_port()
    invite = _invite_file(tmp_path, make_invite(key, identity_of(shard), [f"127.0.0.1:{port}"]))
    local = _swarm("run", str(shard), "--local", *PROMPT)
    (found,) = start_nodes([(shard, ["--experts", "0-15"])], tmp_path / "mdns", env={"SWARM_KEY_FILE": str(key_file)})
    # (a busy machine may take long to start the coordinator: the node waits for it)
    joined = spawn_node(shard, ["--experts", "16-31", "--join", invite, "--join-wait", "300"], tmp_path, "j")
    try:
        run = _swarm("run", str(shard), "--key-file", str(key_file), "--listen", f"127.0.0.1:{port}",
                     "--mdns-interface", "127.0.0.1", "--wait", "60", *PROMPT)  # fmt: skip
        assert run.returncode == 0, run.stderr + joined.log_tail()
        assert run.stdout == local.stdout
        used = [ln.strip() for ln in run.stderr.splitlines() if ln.strip().startswith("node 127.0.0.1:")]
        assert len(used) == 2, run.stderr  # both nodes got calls
        assert any(ln.startswith(f"node {found.address}") for ln in used), run.stderr  # the mDNS one by its own address
        assert "joined the coordinator at" in joined.log_tail(50)
    finally:
        assert stop_nodes([found, joined]) == [0, 0]
