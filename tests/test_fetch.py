"""`swarm node EMPTY_DIR --fetch`: real node processes on 127.0.0.1 fetch their slabs from each other.

A fresh node fetches exactly its slabs (bytes identical to the shard directory) and serves them, and is a
source itself; a source SIGKILLed mid-file is left for another holder, which goes on from the same byte;
an interrupted fetch resumes from its partial file; a source sending damaged bytes is found out by the hash
and never served; a keyed node refuses an unauthenticated Fetch and every path outside what it holds; the
`swarm plan` + mDNS flow. Sources that must be slow sit behind a rate-limited TCP proxy (the test's, so the
nodes carry no test hooks).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from tcp_proxy import TcpProxy

from swarm.coordinator.cli import main
from swarm.coordinator.cli.spawn import LocalNode, spawn_node, start_nodes, stop_nodes
from swarm.node.auth import AUTH_METADATA, SwarmKey, generate_key_text
from swarm.node.client import NodeCallError, NodeClient
from swarm.proto import expert_pb2 as pb
from swarm.proto.channel import CHANNEL_OPTIONS, PROTOCOL_VERSION, SERVICE_NAME
from swarm.sharding.manifest import read_manifest, slab_relpath
from swarm.sharding.shard import shard_model
from swarm.sharding.synth import synthesize
from swarm.sharding.synth_spec import preset

KEY_TEXT = generate_key_text()
KEY = SwarmKey.from_text(KEY_TEXT)
D = 512  # slab files of 3 MiB (three float32 [512, 512] matrices): several 1 MiB chunks each
DAMAGED = (0, 3)
MiB = 1 << 20


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fetch")


@pytest.fixture(scope="module")
def model(work) -> Path:
    """A 2-layer, 4-expert model cut into a shard directory (8 slab files of 3 MiB)."""
    spec = preset(
        "qwen3moe-tiny", n_layers=2, n_expert=4, n_embd=D, expert_ff=D, experts_type="F32", n_vocab=300
    )
    shard = work / "m.swarm"
    shard_model(synthesize(work / "m.gguf", spec), shard)
    return shard


@pytest.fixture(scope="module")
def env(work) -> dict[str, str]:
    key_file = work / "swarm.key"
    key_file.write_text(KEY_TEXT)
    return {"SWARM_KEY_FILE": str(key_file)}


@pytest.fixture(scope="module")
def sources(model, work, env):
    """a: every slab of the shard directory, advertised by mDNS on loopback; b: a copy of it whose slab
    DAMAGED is damaged after b verified it (b, its own check of its files off, still claims it and gives out
    its bytes)."""
    copy = work / "b.swarm"
    shutil.copytree(model, copy)
    a, b = start_nodes(
        [(model, []), (copy, ["--no-mdns", "--recheck", "0"])], work / "sources", prefix="source", env=env
    )
    b.wait_prepared(60)  # every slab of b hashed before the damage
    entry = read_manifest(copy).slab(*DAMAGED)
    with open(copy / entry.path, "r+b") as f:
        f.seek(entry.data_offset + 1000)
        byte = f.read(1)
        f.seek(entry.data_offset + 1000)
        f.write(bytes([byte[0] ^ 0x55]))
    yield {"a": a, "b": b}
    assert stop_nodes([a, b]) == [0, 0], a.log_tail() + b.log_tail()


def fetch_node(dest: Path, args: list[str], work: Path, name: str, env: dict[str, str]) -> LocalNode:
    """Start `swarm node DEST --fetch ARGS` and wait until it serves (its manifest is in place)."""
    return spawn_node(dest, ["--fetch", *args], work, name, env).wait_ready(60)


def wait_fetched(node: LocalNode, timeout: float = 60.0) -> dict:
    """The node's ready file once its fetch has ended (no slab pending)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = json.loads(node.ready_file.read_text())
        if ready["pending"] == 0:
            return ready
        assert node.process.poll() is None, node.log_tail()
        time.sleep(0.05)
    raise AssertionError(f"fetch not done after {timeout} s:\n{node.log_tail()}")


def held(node: LocalNode) -> set[tuple[int, int]]:
    with NodeClient(node.address, key=KEY) as c:
        return set(c.info().held)


def files_under(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}


def assert_same_files(dest: Path, model: Path, keys: set[tuple[int, int]]) -> None:
    """dest holds the manifest and exactly these slab files, each byte for byte the shard directory's."""
    want = {"manifest.json"} | {slab_relpath(*k) for k in keys}
    assert files_under(dest) == want
    for rel in want:
        assert (dest / rel).read_bytes() == (model / rel).read_bytes(), rel


def slabs(layers: range, experts: range) -> set[tuple[int, int]]:
    return {(layer, e) for layer in layers for e in experts}


@pytest.fixture(scope="module")
def fetched(sources, model, work, env):
    """f: fetched experts 1-2 of both layers plus slab 1:3 from a; g: slab 0:2 from f alone."""
    f = fetch_node(
        work / "f", ["--peer", sources["a"].address, "--no-mdns", "--experts", "1-2", "--slab", "1:3"],
        work / "nodes", "f", env,
    )  # fmt: skip
    wait_fetched(f)
    g = fetch_node(work / "g", ["--peer", f.address, "--no-mdns", "--slab", "0:2"], work / "nodes", "g", env)
    wait_fetched(g)
    yield {"f": f, "g": g}
    assert stop_nodes([f, g]) == [0, 0]


def test_a_fresh_node_fetches_exactly_its_slabs_serves_them_and_is_a_source(fetched, sources, model, work):
    f, g = fetched["f"], fetched["g"]
    want = slabs(range(2), range(1, 3)) | {(1, 3)}
    assert_same_files(work / "f", model, want)
    assert held(f) == want
    assert "fetched 5 slabs (15.0 MiB downloaded) from 1 sources" in f.log_file.read_text()
    # it computes what the shard directory's node computes, bit for bit
    rows = torch.randn(3, D, generator=torch.Generator().manual_seed(0))
    with NodeClient(f.address, key=KEY) as cf, NodeClient(sources["a"].address, key=KEY) as ca:
        assert cf.info().serves_files
        assert torch.equal(cf.compute(1, [2, 3], [1, 2], rows), ca.compute(1, [2, 3], [1, 2], rows))
    # and gives out what it fetched: g took its slab from f alone
    assert_same_files(work / "g", model, {(0, 2)})
    assert held(g) == {(0, 2)}


def test_user_mistakes_are_one_line_errors(fetched, sources, work, capsys):
    g, a = fetched["g"], sources["a"]
    key_file = ["--key-file", str(work / "swarm.key")]

    def node(dest: Path, *args: str) -> str:
        assert main(["node", str(dest), "--fetch", "--no-mdns", *key_file, *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], err
        return err[0]

    missing = node(work / "e1", "--peer", g.address, "--experts", "1")  # g has slab 0:2 only
    assert "no source holds 2 of the slabs to fetch (0-1:1)" in missing
    busy = work / "e2"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert "is not empty and holds no manifest.json" in node(busy, "--peer", a.address)
    other = work / "e3"
    other.mkdir()
    manifest = json.loads((work / "f" / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "fingerprint": "0" * 64}))
    assert "no source serves the directory's model 000000000000" in node(other, "--peer", a.address)
    assert "needs sources" in node(work / "e4")
    assert "refuses this swarm key" in main_without_key(work / "e5", a.address, capsys)


def main_without_key(dest: Path, peer: str, capsys) -> str:
    import os

    saved = {k: os.environ.pop(k) for k in ("SWARM_KEY_FILE", "SWARM_KEY") if k in os.environ}
    try:
        assert main(["node", str(dest), "--fetch", "--no-mdns", "--peer", peer]) == 2
    finally:
        os.environ.update(saved)
    return capsys.readouterr().err


def _raw_fetch(address: str, request: pb.FetchRequest, token: str | None) -> grpc.StatusCode:
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        stub = ch.unary_stream(
            f"/{SERVICE_NAME}/Fetch", request_serializer=None, response_deserializer=pb.FileChunk.FromString
        )
        try:
            list(
                stub(
                    request.SerializeToString(),
                    timeout=10,
                    metadata=((AUTH_METADATA, token),) if token else None,
                )
            )
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_a_keyed_node_refuses_unauthenticated_fetches_and_every_path_it_does_not_hold(
    sources, model, work, env
):
    a = sources["a"]
    request = pb.FetchRequest(path="manifest.json", protocol_version=PROTOCOL_VERSION)
    assert _raw_fetch(a.address, request, None) == grpc.StatusCode.UNAUTHENTICATED
    assert _raw_fetch(a.address, request, "v1.garbage") == grpc.StatusCode.UNAUTHENTICATED
    with NodeClient(a.address, key=SwarmKey.from_text("another swarm")) as wrong:
        with pytest.raises(NodeCallError) as e:
            list(wrong.fetch("manifest.json"))
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    manifest = (model / "manifest.json").read_bytes()
    with NodeClient(a.address, key=KEY) as c:
        assert b"".join(data for _, data, _ in c.fetch("manifest.json", offset=100)) == manifest[100:]
        assert [size for _, _, size in c.fetch("manifest.json", offset=len(manifest))] == [len(manifest)]
        for path, code in [
            ("../m.swarm/manifest.json", grpc.StatusCode.INVALID_ARGUMENT),
            ("/etc/passwd", grpc.StatusCode.INVALID_ARGUMENT),
            ("experts/0/../../manifest.json", grpc.StatusCode.INVALID_ARGUMENT),
            ("experts\\0\\1.gguf", grpc.StatusCode.INVALID_ARGUMENT),
            ("", grpc.StatusCode.INVALID_ARGUMENT),
            ("dense.gguf", grpc.StatusCode.NOT_FOUND),
            ("experts/0/9.gguf", grpc.StatusCode.NOT_FOUND),
        ]:
            with pytest.raises(NodeCallError) as e:
                list(c.fetch(path))
            assert e.value.code == code, path
        with pytest.raises(NodeCallError) as e:
            list(c.fetch("manifest.json", offset=len(manifest) + 1))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "past the end" in e.value.details
        c.fingerprint = "f" * 64
        with pytest.raises(NodeCallError) as e:
            list(c.fetch("manifest.json"))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    # a node on a whole GGUF has no slab files to give
    (gguf,) = start_nodes(
        [(work / "m.gguf", ["--no-mdns", "--experts", "0"])], work / "nodes", prefix="gguf", env=env
    )
    try:
        with NodeClient(gguf.address, key=KEY) as c:
            assert not c.info().serves_files
            with pytest.raises(NodeCallError) as e:
                list(c.fetch(slab_relpath(0, 0)))
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        assert stop_nodes([gguf]) == [0]


def test_a_source_with_damaged_bytes_is_found_out_by_the_hash_and_never_served(sources, model, work, env):
    a, b = sources["a"], sources["b"]
    # b (asked first) sends damaged bytes for DAMAGED: discarded, fetched again from a
    h = fetch_node(
        work / "h",
        ["--peer", b.address, "--peer", a.address, "--no-mdns", "--slab", "0:3"],
        work / "nodes",
        "h",
        env,
    )
    try:
        assert wait_fetched(h)["fetch_failed"] == []
        assert_same_files(work / "h", model, {DAMAGED})
        assert "does not verify" in h.log_file.read_text()
    finally:
        h.stop()
    # with b alone, the slab cannot be had: never written under its name, never served; the others are
    i = fetch_node(
        work / "i",
        ["--peer", b.address, "--no-mdns", "--slab", "0:3", "--slab", "0:0"],
        work / "nodes",
        "i",
        env,
    )
    try:
        ready = wait_fetched(i)
        assert ready["fetch_failed"] == ["0:3"]
        assert held(i) == {(0, 0)}
        assert files_under(work / "i") == {"manifest.json", slab_relpath(0, 0)}
        assert "could not fetch slab 0:3" in i.log_file.read_text()
    finally:
        assert stop_nodes([i]) == [0]


def _parts(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.rglob("*.part")}


@pytest.mark.slow
def test_a_source_killed_mid_file_is_left_for_another_holder(sources, model, work, env):
    """Two holders: a slow one (behind the proxy) and a; the slow one is SIGKILLed while it sends, its
    link dropped."""
    (doomed,) = start_nodes([(model, ["--no-mdns"])], work / "nodes", prefix="doomed", env=env)
    proxy = TcpProxy(doomed.address, rate=1 * MiB)
    want = slabs(range(2), range(0, 3))
    try:
        j = fetch_node(
            work / "j", ["--peer", proxy.address, "--peer", sources["a"].address, "--no-mdns", "--experts", "0-2",
                         "--fetch-parallel", "2"],
            work / "nodes", "j", env,
        )  # fmt: skip
        # kill it once it has sent a file's first chunk and half the next, and the slabs the other holder
        # sent already serve
        deadline = time.monotonic() + 30
        while not (
            proxy.sent >= 1.5 * MiB and any(_parts(work / "j").values()) and 0 < len(held(j)) < len(want)
        ):
            assert time.monotonic() < deadline, j.log_tail()
            time.sleep(0.02)
        doomed.process.send_signal(signal.SIGKILL)
        proxy.cut()  # and its link with it: what its socket buffers held is lost too, as on a real network
        doomed.process.wait()
        assert wait_fetched(j)["fetch_failed"] == []
        assert_same_files(work / "j", model, want)
        assert held(j) == want
        log = j.log_file.read_text()
        assert re.search(
            rf"{proxy.address} failed at byte [1-9]\d* of \d+ .*continuing from another holder", log
        ), log
        downloaded = float(re.search(r"fetched 6 slabs \(([\d.]+) MiB downloaded", log).group(1))
        assert downloaded <= 18.0 + 1.0  # the other holder went on from the byte reached, not from 0
        assert stop_nodes([j]) == [0]
    finally:
        proxy.close()
        doomed.stop()


@pytest.mark.slow
def test_an_interrupted_fetch_resumes_from_its_partial_file(sources, model, work, env):
    proxy = TcpProxy(sources["a"].address, rate=2 * MiB)
    dest = work / "k"
    args = ["--peer", proxy.address, "--no-mdns", "--slab", "1:0-1", "--fetch-parallel", "1"]
    try:
        k = fetch_node(dest, args, work / "nodes", "k", env)
        deadline = time.monotonic() + 30
        while not any(n >= MiB for n in _parts(dest).values()):
            assert time.monotonic() < deadline, k.log_tail()
            time.sleep(0.02)
        k.process.send_signal(signal.SIGINT)  # Ctrl-C
        assert k.process.wait(20) == 0
        assert "the partial files are kept" in k.log_file.read_text()
        parts = {p: p.read_bytes() for p in dest.rglob("*.part")}
        assert parts and all(len(b) >= MiB for b in parts.values())
        for p, data in parts.items():  # a prefix of the real file: nothing damaged on the way out
            assert (model / p.relative_to(dest).as_posix().removesuffix(".part")).read_bytes()[
                : len(data)
            ] == data
        kept = sum(len(b) for b in parts.values())
        done = {p.relative_to(dest).as_posix() for p in dest.rglob("*.gguf")}
        remaining = sum((model / slab_relpath(1, e)).stat().st_size for e in (0, 1)) - kept
        remaining -= sum((model / rel).stat().st_size for rel in done)
        proxy.rate, proxy.sent = 64 * MiB, 0
        k2 = fetch_node(dest, args, work / "nodes", "k2", env)
        assert wait_fetched(k2)["fetch_failed"] == []
        assert_same_files(dest, model, {(1, 0), (1, 1)})
        assert proxy.sent <= remaining + 256 * 1024, (proxy.sent, remaining)  # not again from byte 0
        assert f"{kept / MiB:.1f} MiB resumed from partial files" in k2.log_file.read_text()
        assert stop_nodes([k2]) == [0]
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_plan_node_finds_its_sources_by_mdns_and_announces_what_it_fetched(
    sources, model, work, env, capsys
):
    from swarm.node.discovery import browse

    assert main(["plan", str(model), "--capacities", "20MiB,20MiB,20MiB", "--names", "x,y,z", "--json"]) == 0
    plan = work / "plan.json"
    plan.write_text(capsys.readouterr().out)
    mine = {
        tuple(k) for k in next(n for n in json.loads(plan.read_text())["nodes"] if n["name"] == "y")["slabs"]
    }
    y = fetch_node(work / "y", ["--plan", str(plan), "--name", "y"], work / "nodes", "y", env)
    try:
        assert wait_fetched(y)["fetch_failed"] == []
        assert_same_files(work / "y", model, mine)
        assert held(y) == mine
        with browse(interfaces=["127.0.0.1"], key=KEY) as b:
            found = b.wait_for(lambda ns: any(n.port == y.port and n.held == mine for n in ns), timeout=10)
        assert found is not None, "the node announces the slabs it fetched"
    finally:
        assert stop_nodes([y]) == [0]
